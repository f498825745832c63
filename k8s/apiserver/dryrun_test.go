package apiserver_test

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"strings"
	"testing"

	"github.com/curfew-mesh/curfew/k8s/apiserver"
	"github.com/curfew-mesh/curfew/k8s/manifest"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/types"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/client-go/discovery"
	"k8s.io/client-go/discovery/cached/memory"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/restmapper"
)

// fieldManager is the field manager of every apply of these tests.
const fieldManager = "curfew-test"

// The kustomizations that a platform team applies: each must pass the real API server's
// admission and validation with strict field validation. An overlay followed by "+" and
// components is that overlay with the components added (manifest.Compose, in namespace
// curfew), as a team adds the tool server examples of k8s/examples to its own.
var kustomizations = []string{"../base", "../overlays/dev", "../overlays/prod",
	"../overlays/prod+../examples/mcp-http", "../overlays/dev+../examples/mcp-sidecar"}

// build renders one of kustomizations.
func build(dir string) ([]byte, error) {
	overlay, comps, ok := strings.Cut(dir, "+")
	if !ok {
		return manifest.Build(dir)
	}
	return manifest.Compose("curfew", overlay, strings.Split(comps, "+")...)
}

// TestServerSideDryRun applies every object of the base and of each overlay to a real
// kube-apiserver with a server-side dry-run and strict field validation: what the server
// would refuse at `kubectl apply --server-side --dry-run=server --validate=strict` fails
// here with the object and the server's message. It first proves that the server refuses
// an unknown field and a duplicate one, so that it cannot pass by validating nothing.
func TestServerSideDryRun(t *testing.T) {
	a := newApplier(t)

	t.Run("strict validation", func(t *testing.T) {
		testStrictValidation(t, a)
	})
	for _, dir := range kustomizations {
		t.Run(strings.ReplaceAll(dir, "../", ""), func(t *testing.T) {
			data, err := build(dir)
			if err != nil {
				t.Fatal(err)
			}
			objs, err := splitObjects(data)
			if err != nil {
				t.Fatalf("%s: %v", dir, err)
			}
			if len(objs) == 0 {
				t.Fatalf("%s renders no objects", dir)
			}
			// A dry-run does not create a Namespace, and the server refuses objects in a
			// namespace that does not exist: the namespaces are created for real first,
			// then everything is dry-run, the namespaces again included.
			for _, obj := range objs {
				if gvk := obj.GroupVersionKind(); gvk.Group == "" && gvk.Kind == "Namespace" {
					if err := a.apply(t.Context(), obj, false, "Strict"); err != nil {
						t.Fatalf("%s: creating %s: %v", dir, obj, err)
					}
				}
			}
			for _, obj := range objs {
				if err := a.apply(t.Context(), obj, true, "Strict"); err != nil {
					t.Errorf("%s: %s refused by the API server: %v", dir, obj, err)
				}
			}
			if t.Failed() {
				return
			}
			t.Logf("%s: %d objects accepted by the API server (server-side dry-run, strict field validation)", dir, len(objs))
		})
	}
}

// strictnessCheck is a valid Deployment but for the marked line, which each case of
// testStrictValidation replaces.
const strictnessCheck = `apiVersion: apps/v1
kind: Deployment
metadata:
  name: strictness-check
  namespace: default
spec:
  replicas: 1
  selector:
    matchLabels: {app: strictness-check}
  template:
    metadata:
      labels: {app: strictness-check}
    spec:
      containers:
        - name: app
          image: registry.example/app:1
          # EXTRA
`

// testStrictValidation proves that the API server checks the objects as strictly as the
// manifests' dry-run relies on, so that it cannot pass by checking nothing: it refuses an
// unknown field (server-side apply always does: the patch is typed against the schema) and,
// with FieldValidation=Strict only, a duplicate field; the same Deployment without either
// passes, so each refusal is that field's alone.
func testStrictValidation(t *testing.T, a *applier) {
	deployment := func(t *testing.T, extra string) object {
		t.Helper()
		objs, err := splitObjects([]byte(strings.Replace(strictnessCheck, "# EXTRA", extra, 1)))
		if err != nil || len(objs) != 1 {
			t.Fatalf("splitObjects = %d objects, %v; want 1", len(objs), err)
		}
		return objs[0]
	}
	refused := func(t *testing.T, obj object, validation, field string) {
		t.Helper()
		err := a.apply(t.Context(), obj, true, validation)
		if err == nil {
			t.Fatalf("%s with %s was accepted (field validation %s)", obj, field, validation)
		}
		var status apierrors.APIStatus
		if !errors.As(err, &status) || !strings.Contains(err.Error(), field) {
			t.Fatalf("%s with %s: got %v, want the API server's refusal naming %s", obj, field, err, field)
		}
		t.Logf("refused with field validation %s, as it should be: %v", validation, err)
	}

	t.Run("unknown field", func(t *testing.T) {
		refused(t, deployment(t, "bogusField: true"), "Strict", "bogusField")
	})
	t.Run("duplicate field", func(t *testing.T) {
		obj := deployment(t, "image: registry.example/app:2")
		refused(t, obj, "Strict", `"image" already set`)
		// Not refused without Strict: the refusal above is the option's.
		if err := a.apply(t.Context(), obj, true, "Ignore"); err != nil {
			t.Fatalf("%s with a duplicate field refused with field validation Ignore: %v", obj, err)
		}
	})
	t.Run("valid", func(t *testing.T) {
		obj := deployment(t, "")
		if err := a.apply(t.Context(), obj, true, "Strict"); err != nil {
			t.Fatalf("%s refused: %v", obj, err)
		}
	})
}

// applier applies objects to the test's API server with server-side apply.
type applier struct {
	client dynamic.Interface
	mapper meta.RESTMapper
}

// newApplier starts etcd and kube-apiserver for the test, and stops them at its end.
// Without the binaries the test is skipped, and fails under CI=true.
func newApplier(t *testing.T) *applier {
	t.Helper()
	var missing []string
	for _, env := range []string{apiserver.EnvAPIServer, apiserver.EnvEtcd} {
		if os.Getenv(env) == "" {
			missing = append(missing, env)
		}
	}
	if len(missing) > 0 {
		msg := strings.Join(missing, " and ") + " not set (scripts/kube-apiserver.sh builds kube-apiserver, scripts/etcd.sh installs etcd)"
		if os.Getenv("CI") == "true" {
			t.Fatal(msg + "; scripts/test.sh sets them")
		}
		t.Skip(msg)
	}
	s, err := apiserver.Start(t.Context(), apiserver.Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("the servers' last log lines:\n%s", s.Logs())
		}
		if err := s.Stop(); err != nil {
			t.Errorf("stopping the API server: %v", err)
		}
	})
	dc, err := discovery.NewDiscoveryClientForConfig(s.Config)
	if err != nil {
		t.Fatal(err)
	}
	client, err := dynamic.NewForConfig(s.Config)
	if err != nil {
		t.Fatal(err)
	}
	return &applier{client: client, mapper: restmapper.NewDeferredDiscoveryRESTMapper(memory.NewMemCacheClient(dc))}
}

// apply applies obj with server-side apply, forced, as fieldManager, with the given field
// validation (Strict, Warn or Ignore); dryRun makes it a server-side dry-run (DryRun=All):
// admitted, defaulted and validated as for real, but not stored. The body is the object's
// YAML document as rendered, so that the server sees exactly what would be applied.
func (a *applier) apply(ctx context.Context, obj object, dryRun bool, validation string) error {
	gvk := obj.GroupVersionKind()
	mapping, err := a.mapper.RESTMapping(gvk.GroupKind(), gvk.Version)
	if err != nil {
		return fmt.Errorf("no resource for %s: %w", gvk, err)
	}
	var ri dynamic.ResourceInterface = a.client.Resource(mapping.Resource)
	if mapping.Scope.Name() == meta.RESTScopeNameNamespace {
		ns := obj.GetNamespace()
		if ns == "" {
			ns = metav1.NamespaceDefault // where kubectl would put it
		}
		ri = a.client.Resource(mapping.Resource).Namespace(ns)
	}
	force := true
	opts := metav1.PatchOptions{FieldManager: fieldManager, Force: &force, FieldValidation: validation}
	if dryRun {
		opts.DryRun = []string{metav1.DryRunAll}
	}
	_, err = ri.Patch(ctx, obj.GetName(), types.ApplyPatchType, obj.raw, opts)
	return err
}

// object is one document of a YAML stream: as written, and decoded.
type object struct {
	*unstructured.Unstructured
	raw []byte
}

// String names the object: Kind namespace/name (apiVersion).
func (o object) String() string {
	name := o.GetName()
	if ns := o.GetNamespace(); ns != "" {
		name = ns + "/" + name
	}
	return fmt.Sprintf("%s %s (%s)", o.GetKind(), name, o.GetAPIVersion())
}

// splitObjects splits a multi-document YAML stream into its objects, skipping empty
// documents.
func splitObjects(data []byte) ([]object, error) {
	r := utilyaml.NewYAMLReader(bufio.NewReader(bytes.NewReader(data)))
	var objs []object
	for {
		doc, err := r.Read()
		if errors.Is(err, io.EOF) {
			return objs, nil
		}
		if err != nil {
			return nil, fmt.Errorf("document %d: %w", len(objs)+1, err)
		}
		obj := object{Unstructured: &unstructured.Unstructured{}, raw: doc}
		if err := utilyaml.NewYAMLOrJSONDecoder(bytes.NewReader(doc), len(doc)).Decode(&obj.Object); err != nil {
			if errors.Is(err, io.EOF) { // only comments or blank
				continue
			}
			return nil, fmt.Errorf("document %d: %w", len(objs)+1, err)
		}
		if len(obj.Object) == 0 {
			continue
		}
		if obj.GetKind() == "" || obj.GetAPIVersion() == "" || obj.GetName() == "" {
			return nil, fmt.Errorf("document %d has no apiVersion, kind or name:\n%s", len(objs)+1, doc)
		}
		objs = append(objs, obj)
	}
}
