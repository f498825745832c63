package release_test

import (
	"bytes"
	"context"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/curfew-mesh/curfew/internal/meshproc"
	"github.com/curfew-mesh/curfew/internal/release"
)

// repo returns the repository root.
func repo(t *testing.T) string {
	t.Helper()
	r, err := meshproc.Repo()
	if err != nil {
		t.Fatal(err)
	}
	return r
}

// breaking runs `buf breaking` of the module at dir (its buf.yaml) against image and
// returns its output and whether it found a break.
func breaking(t *testing.T, bufBin, dir, image string) (string, bool) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, bufBin, "breaking", "--against", image)
	cmd.Dir = dir
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	err := cmd.Run()
	var exit *exec.ExitError
	switch {
	case err == nil:
		return out.String(), false
	case errorAs(err, &exit) && exit.ExitCode() == 100: // buf's exit code for findings
		return out.String(), true
	default:
		t.Fatalf("buf breaking in %s: %v\n%s", dir, err, out.String())
		return "", false
	}
}

func errorAs(err error, target **exec.ExitError) bool {
	e, ok := err.(*exec.ExitError) //nolint:errorlint // exec returns it unwrapped
	if ok {
		*target = e
	}
	return ok
}

// againstLatest returns what a buf breaking check against the newest release needs: the
// repository root, buf, and the release's image.
func againstLatest(t *testing.T) (root, buf string, latest release.Image) {
	t.Helper()
	root = repo(t)
	buf = meshproc.Tool(t, "buf")
	latest, err := release.Latest(root)
	if err != nil {
		t.Fatal(err)
	}
	return root, buf, latest
}

// The API on this tree breaks nothing that the newest release's callers rely on: the
// check CI runs on every change.
func TestCompatibleWithLatestRelease(t *testing.T) {
	root, b, latest := againstLatest(t)
	if out, broke := breaking(t, b, root, latest.Path); broke {
		t.Fatalf("the protos break the API of release %s (see docs/api.md, Compatibility):\n%s", latest.Version, out)
	}
}

// Removing a field from a public message, in a scratch copy of proto/, is caught against
// the committed release image, naming the message and the field; the unchanged copy
// passes, so the failure is the removal's.
func TestRemovedFieldIsCaught(t *testing.T) {
	root, b, latest := againstLatest(t)
	scratch := t.TempDir()
	copyModule(t, root, scratch)
	if out, broke := breaking(t, b, scratch, latest.Path); broke {
		t.Fatalf("the unchanged copy already breaks %s:\n%s", latest.Version, out)
	}

	file := filepath.Join(scratch, "proto", "curfew", "orchestrator", "v1", "orchestrator.proto")
	src, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	field := regexp.MustCompile(`(?m)^  bool continue_on_disconnect = 3;\n`)
	if !field.Match(src) {
		t.Fatal("RunRequest.continue_on_disconnect not found: update this test's field")
	}
	if err := os.WriteFile(file, field.ReplaceAll(src, nil), 0o600); err != nil {
		t.Fatal(err)
	}
	out, broke := breaking(t, b, scratch, latest.Path)
	if !broke {
		t.Fatalf("removing RunRequest.continue_on_disconnect was not caught against %s:\n%s", latest.Version, out)
	}
	if !strings.Contains(out, "continue_on_disconnect") || !strings.Contains(out, "RunRequest") {
		t.Errorf("buf's finding does not name the message and the field:\n%s", out)
	}
}

// Every release image has its section in CHANGELOG.md.
func TestChangelogNamesEveryRelease(t *testing.T) {
	root := repo(t)
	imgs, err := release.Images(root)
	if err != nil {
		t.Fatal(err)
	}
	if len(imgs) == 0 {
		t.Fatal("no release image")
	}
	log, err := os.ReadFile(filepath.Join(root, "CHANGELOG.md"))
	if err != nil {
		t.Fatal(err)
	}
	for _, img := range imgs {
		if !bytes.Contains(log, []byte("\n## ["+img.Version+"]")) {
			t.Errorf("CHANGELOG.md has no section \"## [%s]\"", img.Version)
		}
	}
}

// copyModule copies the buf module (buf.yaml and the .proto files under proto/) to dst.
func copyModule(t *testing.T, root, dst string) {
	t.Helper()
	cp := func(rel string) {
		b, err := os.ReadFile(filepath.Join(root, rel))
		if err != nil {
			t.Fatal(err)
		}
		p := filepath.Join(dst, rel)
		if err := os.MkdirAll(filepath.Dir(p), 0o750); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, b, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	cp("buf.yaml")
	err := filepath.WalkDir(filepath.Join(root, "proto"), func(p string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() || !strings.HasSuffix(p, ".proto") {
			return err
		}
		rel, err := filepath.Rel(root, p)
		if err != nil {
			return err
		}
		cp(rel)
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}

// Images orders by version, not by name (v0.10.0 after v0.9.0), and refuses a stray file.
func TestImagesOrder(t *testing.T) {
	root := t.TempDir()
	dir := filepath.Join(root, release.Dir)
	if err := os.MkdirAll(dir, 0o750); err != nil {
		t.Fatal(err)
	}
	for _, v := range []string{"v0.10.0", "v0.9.0", "v1.0.0", "v0.9.1"} {
		if err := os.WriteFile(filepath.Join(dir, v+".binpb"), nil, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	imgs, err := release.Images(root)
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, img := range imgs {
		got = append(got, img.Version)
	}
	if want := "v0.9.0 v0.9.1 v0.10.0 v1.0.0"; strings.Join(got, " ") != want {
		t.Errorf("order = %v, want %s", got, want)
	}
	if err := os.WriteFile(filepath.Join(dir, "v0.11.0-rc1.binpb"), nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := release.Images(root); err == nil || !strings.Contains(err.Error(), "v0.11.0-rc1") {
		t.Errorf("a stray file was not refused by name: %v", err)
	}
}

func TestParseVersionRefuses(t *testing.T) {
	for _, v := range []string{"", "v1", "v1.2", "1.2.3", "v01.2.3", "v1.2.3-rc1", "v1.2.3+b", "v1.2.3.4"} {
		if _, err := release.ParseVersion(v); err == nil {
			t.Errorf("ParseVersion(%q) accepted", v)
		}
	}
}
