package manifest_test

import (
	"bytes"
	"debug/elf"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/moby/buildkit/frontend/dockerfile/instructions"
	"github.com/moby/buildkit/frontend/dockerfile/parser"
)

// images maps each image the manifests and docs/kubernetes.md name to its Dockerfile, relative to
// the repository root (the build context).
var images = map[string]string{
	"ghcr.io/curfew-mesh/curfew-orchestrator": "services/orchestrator/Dockerfile",
	"ghcr.io/curfew-mesh/curfew-toolrunner":   "services/toolrunner/Dockerfile",
	"ghcr.io/curfew-mesh/curfew-subagent":     "services/subagent/Dockerfile",
	"ghcr.io/curfew-mesh/curfew-modelproxy":   "services/modelproxy/Dockerfile",
	"ghcr.io/curfew-mesh/curfew":              "cmd/curfew/Dockerfile",
}

// testVersion is the VERSION build argument of the test builds.
const testVersion = "v0.0.0-k8s-manifest-test"

const versionVar = "github.com/curfew-mesh/curfew/mesh/service.Version"

// dockerfile is a parsed Dockerfile.
type dockerfile struct {
	path   string // relative to the repository root
	stages []instructions.Stage
}

func parseDockerfile(t *testing.T, rel string) dockerfile {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(repoRoot(t), rel))
	if err != nil {
		t.Fatal(err)
	}
	res, err := parser.Parse(bytes.NewReader(b))
	if err != nil {
		t.Fatalf("%s: %v", rel, err)
	}
	stages, _, err := instructions.Parse(res.AST, nil)
	if err != nil {
		t.Fatalf("%s: %v", rel, err)
	}
	return dockerfile{path: rel, stages: stages}
}

func repoRoot(t *testing.T) string {
	t.Helper()
	root, err := filepath.Abs("../..")
	if err != nil {
		t.Fatal(err)
	}
	return root
}

// goBuild returns the shell command of the build stage's go build.
func (d dockerfile) goBuild(t *testing.T) string {
	t.Helper()
	for _, c := range d.stages[0].Commands {
		if r, ok := c.(*instructions.RunCommand); ok && r.PrependShell && strings.Contains(strings.Join(r.CmdLine, " "), "go build") {
			return strings.Join(r.CmdLine, " ")
		}
	}
	t.Fatalf("%s: no go build in the first stage", d.path)
	return ""
}

// entrypoint returns the final stage's exec-form ENTRYPOINT.
func (d dockerfile) entrypoint(t *testing.T) []string {
	t.Helper()
	for _, c := range d.stages[len(d.stages)-1].Commands {
		if e, ok := c.(*instructions.EntrypointCommand); ok {
			if e.PrependShell {
				t.Fatalf("%s: ENTRYPOINT in shell form; the runtime image has no shell", d.path)
			}
			return e.CmdLine
		}
	}
	t.Fatalf("%s: no ENTRYPOINT in the final stage", d.path)
	return nil
}

// buildLikeDockerfile runs the Dockerfile's go build command on this checkout with
// VERSION=testVersion and writes the binary to out.
func buildLikeDockerfile(t *testing.T, rel, out string) error {
	d := parseDockerfile(t, rel)
	cmdline := d.goBuild(t)
	o := regexp.MustCompile(`-o\s+(\S+)`)
	if !o.MatchString(cmdline) {
		t.Fatalf("%s: go build without -o", rel)
	}
	cmdline = o.ReplaceAllLiteralString(cmdline, "-o "+strconv.Quote(out))
	return runShell(repoRoot(t), cmdline, "VERSION="+testVersion)
}

// The images build static binaries, stamped with VERSION, that run as a non-root user on
// a minimal runtime image; every image the manifests name has its Dockerfile.
func TestImagesAreStaticNonRootAndVersioned(t *testing.T) {
	bins := binaries(t)
	workUses := goWorkUses(t)
	for image, rel := range images {
		t.Run(rel, func(t *testing.T) {
			d := parseDockerfile(t, rel)
			if len(d.stages) < 2 {
				t.Fatalf("%d stage(s); want a multi-stage build", len(d.stages))
			}
			build, final := d.stages[0], d.stages[len(d.stages)-1]
			if !strings.HasPrefix(final.BaseName, "gcr.io/distroless/static") {
				t.Errorf("runtime image %s; want distroless static (no libc, shell or package manager)", final.BaseName)
			}
			var user string
			var args []string
			for _, c := range final.Commands {
				switch c := c.(type) {
				case *instructions.UserCommand:
					user = c.User
				case *instructions.RunCommand:
					t.Errorf("RUN in the runtime stage: %v", c.CmdLine)
				case *instructions.CopyCommand:
					if c.From != build.Name {
						t.Errorf("the runtime stage copies from %q, want only the build stage %q", c.From, build.Name)
					}
				}
			}
			uid, _, _ := strings.Cut(user, ":")
			if n, err := strconv.Atoi(uid); err != nil || n == 0 {
				t.Errorf("USER %q; want a numeric non-root uid (runAsNonRoot can only check a number)", user)
			}
			for _, c := range build.Commands {
				switch c := c.(type) {
				case *instructions.ArgCommand:
					for _, a := range c.Args {
						args = append(args, a.Key)
					}
				case *instructions.CopyCommand:
					for _, src := range c.SourcePaths {
						if _, err := os.Stat(filepath.Join(repoRoot(t), src)); err != nil {
							t.Errorf("COPY %s: not in the repository", src)
						}
					}
				}
			}
			if !slices.Contains(args, "VERSION") {
				t.Error("the build stage has no ARG VERSION")
			}
			cmd := d.goBuild(t)
			for _, want := range []string{"CGO_ENABLED=0", "-trimpath", "-X " + versionVar + "=${VERSION}"} {
				if !strings.Contains(cmd, want) {
					t.Errorf("go build lacks %q: %s", want, cmd)
				}
			}
			copied := map[string]bool{}
			for _, c := range build.Commands {
				if cp, ok := c.(*instructions.CopyCommand); ok {
					for _, src := range cp.SourcePaths {
						if filepath.Base(src) == "go.mod" {
							copied[filepath.Dir(src)] = true
						}
					}
				}
			}
			for _, m := range workUses {
				if !copied[m] {
					t.Errorf("go.work uses %s, but its go.mod is not copied before go mod download", m)
				}
			}

			ep := d.entrypoint(t)
			name := filepath.Base(ep[0])
			bin := filepath.Join(bins, name)
			f, err := elf.Open(bin)
			if err != nil {
				t.Fatalf("%s: %v", bin, err)
			}
			defer func() { _ = f.Close() }()
			for _, p := range f.Progs {
				if p.Type == elf.PT_INTERP {
					t.Errorf("%s is dynamically linked (has an ELF interpreter)", name)
				}
			}
			if libs, _ := f.ImportedLibraries(); len(libs) > 0 {
				t.Errorf("%s needs shared libraries %v", name, libs)
			}
			b, err := os.ReadFile(bin)
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.Contains(b, []byte(testVersion)) {
				t.Errorf("%s does not carry VERSION %s", name, testVersion)
			}
			if image != "ghcr.io/curfew-mesh/curfew" && "ghcr.io/curfew-mesh/curfew-"+name != image {
				t.Errorf("image %s runs %s", image, name)
			}
		})
	}
	each(t, func(t *testing.T, s *set) {
		for _, c := range components {
			img := container(t, s.deployments[c]).Image
			name, tag, _ := strings.Cut(img, ":")
			if images[name] == "" || name != "ghcr.io/curfew-mesh/curfew-"+c {
				t.Errorf("%s runs image %s, which no Dockerfile here builds for it", c, img)
			}
			if tag == "" || tag == "latest" {
				t.Errorf("%s: image %s; want a pinned version tag", c, img)
			}
		}
	})
}

// goWorkUses returns the module directories go.work uses, relative to the root.
func goWorkUses(t *testing.T) []string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(repoRoot(t), "go.work"))
	if err != nil {
		t.Fatal(err)
	}
	var uses []string
	for _, m := range regexp.MustCompile(`(?m)^\s*(\./\S*|\.)\s*$`).FindAllStringSubmatch(string(b), -1) {
		uses = append(uses, filepath.Clean(m[1]))
	}
	if len(uses) < 2 {
		t.Fatalf("go.work: found uses %v", uses)
	}
	return uses
}
