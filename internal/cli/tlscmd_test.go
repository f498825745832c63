package cli

import (
	"bytes"
	"context"
	"encoding/base64"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// curfew tls init makes the CA once and re-issues the certificates at each run;
// k8s-secrets prints one Secret per service holding exactly its files, never the CA key.
func TestTLSInitAndK8sSecrets(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "tls")
	run := func(args ...string) (string, int) {
		var out, errb bytes.Buffer
		code := Main(context.Background(), append([]string{"tls"}, args...), nil, &out, &errb)
		return out.String() + errb.String(), code
	}
	if out, code := run("init", dir, "--host", "api.example.com"); code != ExitOK {
		t.Fatalf("tls init: %d %s", code, out)
	}
	ca1, _ := os.ReadFile(filepath.Join(dir, "ca.crt"))
	crt1, _ := os.ReadFile(filepath.Join(dir, "orchestrator.crt"))
	if out, code := run("init", dir); code != ExitOK {
		t.Fatalf("tls init again: %d %s", code, out)
	}
	ca2, _ := os.ReadFile(filepath.Join(dir, "ca.crt"))
	crt2, _ := os.ReadFile(filepath.Join(dir, "orchestrator.crt"))
	if !bytes.Equal(ca1, ca2) || bytes.Equal(crt1, crt2) {
		t.Fatal("a second init must keep the CA and re-issue the certificates")
	}
	out, code := run("k8s-secrets", dir, "--namespace", "mesh")
	if code != ExitOK {
		t.Fatalf("k8s-secrets: %d %s", code, out)
	}
	caKey, _ := os.ReadFile(filepath.Join(dir, "ca.key"))
	docs := strings.Split(out, "\n---\n")
	if len(docs) != len(meshServices) {
		t.Fatalf("%d documents, want %d:\n%s", len(docs), len(meshServices), out)
	}
	data := regexp.MustCompile(`(?m)^  ([a-z.-]+): ([A-Za-z0-9+/=]+)$`)
	for i, svc := range meshServices {
		doc := docs[i]
		if !strings.Contains(doc, "name: curfew-tls-"+svc+"\n") || !strings.Contains(doc, "namespace: mesh\n") {
			t.Errorf("Secret %d:\n%s", i, doc)
		}
		got := map[string]bool{}
		_, section, _ := strings.Cut(doc, "\ndata:\n")
		for _, m := range data.FindAllStringSubmatch(section, -1) {
			b, err := base64.StdEncoding.DecodeString(m[2])
			if err != nil {
				t.Fatal(err)
			}
			want, _ := os.ReadFile(filepath.Join(dir, m[1]))
			if !bytes.Equal(b, want) || bytes.Equal(b, caKey) {
				t.Errorf("%s: %s is not the file's content, or is the CA key", svc, m[1])
			}
			got[m[1]] = true
		}
		if len(got) != 3 || !got["ca.crt"] || !got[svc+".crt"] || !got[svc+".key"] {
			t.Errorf("%s's Secret holds %v", svc, got)
		}
	}
	if _, code := run("k8s-secrets", dir, "--namespace", "Bad NS"); code != ExitUsage {
		t.Errorf("a bad namespace: exit %d", code)
	}
	if out, code := run("k8s-secrets", t.TempDir()); code != ExitFail || !strings.Contains(out, "curfew tls init") {
		t.Errorf("an empty DIR: exit %d %s", code, out)
	}
	if _, code := run("init", dir, "--host", "a b"); code != ExitUsage {
		t.Errorf("a bad --host: exit %d", code)
	}
}
