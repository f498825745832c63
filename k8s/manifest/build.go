package manifest

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"

	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/serializer/json"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/client-go/kubernetes/scheme"
	"sigs.k8s.io/kustomize/api/krusty"
	"sigs.k8s.io/kustomize/kyaml/filesys"
)

// Build runs kustomize on dir (a directory holding a kustomization.yaml) and returns the
// rendered objects as one multi-document YAML stream, as `kubectl kustomize dir` would.
func Build(dir string) ([]byte, error) {
	k := krusty.MakeKustomizer(krusty.MakeDefaultOptions())
	m, err := k.Run(filesys.MakeFsOnDisk(), dir)
	if err != nil {
		return nil, fmt.Errorf("kustomize build %s: %w", dir, err)
	}
	return m.AsYaml()
}

// Decode decodes a multi-document YAML stream strictly into the Kubernetes Go types: a
// field the type does not have, a duplicate field or a kind the client-go scheme does not
// know is an error naming the document.
func Decode(stream []byte) ([]runtime.Object, error) {
	ser := json.NewSerializerWithOptions(json.DefaultMetaFactory, scheme.Scheme, scheme.Scheme,
		json.SerializerOptions{Yaml: true, Strict: true})
	r := utilyaml.NewYAMLReader(bufioReader(stream))
	var objs []runtime.Object
	for i := 0; ; i++ {
		doc, err := r.Read()
		if errors.Is(err, io.EOF) {
			return objs, nil
		}
		if err != nil {
			return nil, fmt.Errorf("document %d: %w", i, err)
		}
		if len(bytes.TrimSpace(doc)) == 0 {
			continue
		}
		obj, gvk, err := ser.Decode(doc, nil, nil)
		if err != nil {
			name := ""
			if gvk != nil {
				name = gvk.Kind + " "
			}
			return nil, fmt.Errorf("document %d (%s%s): %w", i, name, firstLine(doc, "name:"), err)
		}
		objs = append(objs, obj)
	}
}

// Compose builds overlay (a kustomization directory) with the given kustomize components
// added after its own, in namespace, as a platform team's overlay would list them:
//
//	namespace: namespace
//	resources: [overlay]
//	components: [components...]
//
// It writes that kustomization to a temporary directory; the result is Build's.
func Compose(namespace, overlay string, components ...string) ([]byte, error) {
	dir, err := os.MkdirTemp("", "curfew-kustomize-")
	if err != nil {
		return nil, err
	}
	defer func() { _ = os.RemoveAll(dir) }()
	// kustomize refuses absolute paths: each is given relative to dir.
	rel := func(p string) (string, error) {
		a, err := filepath.Abs(p)
		if err != nil {
			return "", err
		}
		return filepath.Rel(dir, a)
	}
	var b strings.Builder
	fmt.Fprintf(&b, "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nnamespace: %q\nresources:\n", namespace)
	p, err := rel(overlay)
	if err != nil {
		return nil, err
	}
	fmt.Fprintf(&b, "  - %q\ncomponents:\n", p)
	for _, c := range components {
		p, err := rel(c)
		if err != nil {
			return nil, err
		}
		fmt.Fprintf(&b, "  - %q\n", p)
	}
	if err := os.WriteFile(filepath.Join(dir, "kustomization.yaml"), []byte(b.String()), 0o600); err != nil {
		return nil, err
	}
	y, err := Build(dir)
	if err != nil {
		return nil, fmt.Errorf("%s with components %v: %w", overlay, components, err)
	}
	return y, nil
}
