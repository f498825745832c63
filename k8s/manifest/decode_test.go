package manifest_test

import (
	"strings"
	"testing"

	"github.com/curfew-mesh/curfew/k8s/manifest"
)

func TestTreesBuildAndDecodeStrictly(t *testing.T) {
	each(t, func(t *testing.T, s *set) {
		if len(s.objs) == 0 {
			t.Fatal("no objects")
		}
		curfew := 0 // the tool server examples add Deployments of their own
		for _, d := range s.deployments {
			if strings.HasPrefix(d.Name, "curfew-") {
				curfew++
			}
		}
		if curfew != len(components) {
			t.Fatalf("%d curfew Deployments, want one per service %v", curfew, components)
		}
		for _, c := range components {
			if s.deployments[c] == nil {
				t.Errorf("no Deployment of %s", c)
			}
		}
		if len(s.namespaces) != 1 || s.namespaces[0].Name != "curfew" {
			t.Errorf("want the one namespace curfew, got %d", len(s.namespaces))
		}
		for _, o := range s.objs {
			if m, ok := o.(interface{ GetNamespace() string }); ok {
				kind := o.GetObjectKind().GroupVersionKind().Kind
				if kind != "Namespace" && m.GetNamespace() != "curfew" {
					t.Errorf("%s in namespace %q, want curfew", kind, m.GetNamespace())
				}
			}
		}
	})
}

// The decoder is strict: these must fail, or the test above proves nothing.
func TestDecodeRefusesUnknownAndDuplicateFields(t *testing.T) {
	for name, doc := range map[string]string{
		"unknown field": `apiVersion: apps/v1
kind: Deployment
metadata: {name: x}
spec:
  selector: {matchLabels: {a: b}}
  template:
    metadata: {labels: {a: b}}
    spec:
      containers: [{name: x, image: x, bogusField: 1}]
`,
		"duplicate field": `apiVersion: v1
kind: Service
metadata: {name: x}
spec:
  clusterIP: None
  clusterIP: None
`,
		"unknown kind": `apiVersion: monitoring.coreos.com/v1
kind: ServiceMonitor
metadata: {name: x}
`,
	} {
		t.Run(name, func(t *testing.T) {
			_, err := manifest.Decode([]byte(doc))
			if err == nil {
				t.Fatal("decoded; want an error")
			}
			if name == "unknown field" && !strings.Contains(err.Error(), "bogusField") {
				t.Errorf("error %q does not name the field", err)
			}
		})
	}
}
