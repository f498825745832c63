package manifest_test

import (
	"strings"
	"sync"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	autoscalingv2 "k8s.io/api/autoscaling/v2"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	policyv1 "k8s.io/api/policy/v1"
	"k8s.io/apimachinery/pkg/runtime"

	"github.com/curfew-mesh/curfew/k8s/manifest"
)

// trees are the kustomizations a platform team may apply, relative to this package: a
// directory, or an overlay with the components after its "+" (manifest.Compose, in
// namespace curfew), as a team adds the tool server examples of k8s/examples to its own.
var trees = []string{"../base", "../overlays/dev", "../overlays/prod",
	"../overlays/prod+../examples/mcp-http", "../overlays/dev+../examples/mcp-sidecar", "../overlays/prod+../components/console"}

// buildTree renders one of trees.
func buildTree(tree string) ([]byte, error) {
	overlay, comps, ok := strings.Cut(tree, "+")
	if !ok {
		return manifest.Build(tree)
	}
	return manifest.Compose("curfew", overlay, strings.Split(comps, "+")...)
}

// components are curfew's four services, in DESIGN.md's order.
var components = []string{"orchestrator", "toolrunner", "subagent", "modelproxy"}

// set is one rendered tree, decoded and indexed by kind.
type set struct {
	tree         string
	objs         []runtime.Object
	deployments  map[string]*appsv1.Deployment // by component (app.kubernetes.io/name)
	statefulSets []*appsv1.StatefulSet
	services     map[string]*corev1.Service // by name
	pdbs         []*policyv1.PodDisruptionBudget
	hpas         []*autoscalingv2.HorizontalPodAutoscaler
	policies     []*networkingv1.NetworkPolicy
	configMaps   map[string]*corev1.ConfigMap // by name, hash suffix included
	namespaces   []*corev1.Namespace
}

var (
	renderOnce sync.Once
	rendered   map[string]*set
	renderErr  error
)

// render builds and strictly decodes every tree once per test binary.
func render(t *testing.T) map[string]*set {
	t.Helper()
	renderOnce.Do(func() {
		rendered = map[string]*set{}
		for _, tree := range trees {
			y, err := buildTree(tree)
			if err != nil {
				renderErr = err
				return
			}
			objs, err := manifest.Decode(y)
			if err != nil {
				renderErr = err
				return
			}
			s := &set{tree: strings.ReplaceAll(tree, "../", ""), objs: objs, deployments: map[string]*appsv1.Deployment{},
				services: map[string]*corev1.Service{}, configMaps: map[string]*corev1.ConfigMap{}}
			for _, o := range objs {
				switch o := o.(type) {
				case *appsv1.Deployment:
					s.deployments[o.Spec.Template.Labels["app.kubernetes.io/name"]] = o
				case *appsv1.StatefulSet:
					s.statefulSets = append(s.statefulSets, o)
				case *corev1.Service:
					s.services[o.Name] = o
				case *policyv1.PodDisruptionBudget:
					s.pdbs = append(s.pdbs, o)
				case *autoscalingv2.HorizontalPodAutoscaler:
					s.hpas = append(s.hpas, o)
				case *networkingv1.NetworkPolicy:
					s.policies = append(s.policies, o)
				case *corev1.ConfigMap:
					s.configMaps[o.Name] = o
				case *corev1.Namespace:
					s.namespaces = append(s.namespaces, o)
				}
			}
			rendered[tree] = s
		}
	})
	if renderErr != nil {
		t.Fatal(renderErr)
	}
	return rendered
}

// each runs fn as a subtest per rendered tree.
func each(t *testing.T, fn func(t *testing.T, s *set)) {
	for _, tree := range trees {
		s := render(t)[tree]
		t.Run(s.tree, func(t *testing.T) { fn(t, s) })
	}
}
