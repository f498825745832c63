package e2e

import (
	"encoding/json"
	"errors"
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"io"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/curfew-mesh/curfew/internal/meshproc"
	"github.com/curfew-mesh/curfew/mesh/service"
)

const envHeader = `Golden file: the CURFEW_* environment variables the %s binary reads, sorted.
Derived from the source, not written by hand: the non-test Go files (for this GOOS and
GOARCH) of this repository's packages in 'go list -deps' of its main package are parsed,
and a variable is read where a function whose name contains "env" (os.Getenv,
os.LookupEnv, a getenv parameter, ...) is called with a constant CURFEW_* string, where
service.EnvName is called with a constant flag name, and, for a binary that parses its
flags with service.Parse (which fills every flag from its CURFEW_* variable), for each
flag its -h lists.
Rewrite with: go test ./e2e/ -run Golden -count=1 -update (and say why in the commit).`

const (
	repoModule     = "github.com/curfew-mesh/curfew"
	servicePackage = repoModule + "/mesh/service"
)

var (
	envVar   = regexp.MustCompile(`^CURFEW_[A-Z0-9_]+$`)
	readsEnv = regexp.MustCompile(`(?i)env`)
)

// listedPackage is the part of `go list -json` the scan reads.
type listedPackage struct {
	ImportPath string
	Dir        string
	GoFiles    []string
	CgoFiles   []string
}

// repoDeps returns this repository's packages that the binary's main package pkg
// depends on, itself included, with their non-test Go files.
func repoDeps(t *testing.T, pkg string) []listedPackage {
	t.Helper()
	repo, err := meshproc.Repo()
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command("go", "list", "-deps", "-json=ImportPath,Dir,GoFiles,CgoFiles", pkg)
	cmd.Dir = repo
	out, err := cmd.Output()
	if err != nil {
		var ee *exec.ExitError
		if errors.As(err, &ee) {
			t.Fatalf("go list -deps %s: %v\n%s", pkg, err, ee.Stderr)
		}
		t.Fatalf("go list -deps %s: %v", pkg, err)
	}
	var pkgs []listedPackage
	dec := json.NewDecoder(strings.NewReader(string(out)))
	for {
		var p listedPackage
		if err := dec.Decode(&p); errors.Is(err, io.EOF) {
			break
		} else if err != nil {
			t.Fatal(err)
		}
		if p.ImportPath == repoModule || strings.HasPrefix(p.ImportPath, repoModule+"/") {
			pkgs = append(pkgs, p)
		}
	}
	if len(pkgs) < 3 {
		t.Fatalf("go list -deps %s: only %d packages of this repository", pkg, len(pkgs))
	}
	return pkgs
}

// parsedPackage is one package's files and its package-level string constants.
type parsedPackage struct {
	files  []*ast.File
	consts map[string]string
}

// envReads returns the CURFEW_* variables the packages read (see envHeader), and whether
// one of them calls service.Parse.
func envReads(t *testing.T, pkgs []listedPackage) (vars []string, parsesFlags bool) {
	t.Helper()
	fset := token.NewFileSet()
	parsed := map[string]*parsedPackage{}
	for _, p := range pkgs {
		pp := &parsedPackage{consts: map[string]string{}}
		for _, name := range append(slices.Clone(p.GoFiles), p.CgoFiles...) {
			f, err := parser.ParseFile(fset, filepath.Join(p.Dir, name), nil, parser.SkipObjectResolution)
			if err != nil {
				t.Fatal(err)
			}
			pp.files = append(pp.files, f)
			for _, d := range f.Decls {
				gd, ok := d.(*ast.GenDecl)
				if !ok || gd.Tok != token.CONST {
					continue
				}
				for _, s := range gd.Specs {
					vs := s.(*ast.ValueSpec)
					for i, n := range vs.Names {
						if i < len(vs.Values) {
							if lit, ok := vs.Values[i].(*ast.BasicLit); ok && lit.Kind == token.STRING {
								if v, err := strconv.Unquote(lit.Value); err == nil {
									pp.consts[n.Name] = v
								}
							}
						}
					}
				}
			}
		}
		parsed[p.ImportPath] = pp
	}

	seen := map[string]bool{}
	for path, pp := range parsed {
		for _, f := range pp.files {
			imports := map[string]string{} // name in this file → import path
			for _, im := range f.Imports {
				p, _ := strconv.Unquote(im.Path.Value)
				name := p[strings.LastIndex(p, "/")+1:]
				if im.Name != nil {
					name = im.Name.Name
				}
				imports[name] = p
			}
			// constant returns the string constant e stands for, if it is one this scan
			// can see: a literal, or a constant of this repository's packages.
			constant := func(e ast.Expr) (string, bool) {
				switch e := e.(type) {
				case *ast.BasicLit:
					if e.Kind == token.STRING {
						v, err := strconv.Unquote(e.Value)
						return v, err == nil
					}
				case *ast.Ident:
					v, ok := pp.consts[e.Name]
					return v, ok
				case *ast.SelectorExpr:
					if x, ok := e.X.(*ast.Ident); ok {
						if other := parsed[imports[x.Name]]; other != nil {
							v, ok := other.consts[e.Sel.Name]
							return v, ok
						}
					}
				}
				return "", false
			}
			ast.Inspect(f, func(n ast.Node) bool {
				call, ok := n.(*ast.CallExpr)
				if !ok {
					return true
				}
				var fn, qual string
				switch c := call.Fun.(type) {
				case *ast.Ident:
					fn, qual = c.Name, path
				case *ast.SelectorExpr:
					fn = c.Sel.Name
					if x, ok := c.X.(*ast.Ident); ok {
						qual = imports[x.Name]
					}
				default:
					return true
				}
				switch {
				case fn == "EnvName" && (qual == servicePackage) && len(call.Args) == 1:
					if v, ok := constant(call.Args[0]); ok {
						seen[service.EnvName(v)] = true
					}
				case fn == "Parse" && qual == servicePackage:
					parsesFlags = true
				case readsEnv.MatchString(fn):
					for _, a := range call.Args {
						if v, ok := constant(a); ok && envVar.MatchString(v) {
							seen[v] = true
						}
					}
				}
				return true
			})
		}
	}
	for v := range seen {
		vars = append(vars, v)
	}
	slices.Sort(vars)
	return vars, parsesFlags
}

// The CURFEW_* variables each binary reads are the golden ones.
func TestGoldenEnv(t *testing.T) {
	t.Parallel()
	bin := goldenBin(t)
	for _, name := range binaries {
		pkg := "./cmd/curfew"
		if name != "curfew" {
			pkg = repoModule + "/services/" + name + "/cmd/" + name
		}
		vars, parsesFlags := envReads(t, repoDeps(t, pkg))
		if parsesFlags {
			r := execBinary(t, bin, name, nil, 30*time.Second, "-h")
			flags := flagLine.FindAllStringSubmatch(r.stderr, -1)
			if len(flags) < 10 {
				t.Fatalf("%s -h lists too few flags:\n%s", name, r.stderr)
			}
			for _, f := range flags {
				vars = append(vars, service.EnvName(f[1]))
			}
			slices.Sort(vars)
			vars = slices.Compact(vars)
		}
		if len(vars) == 0 {
			t.Errorf("%s: no CURFEW_* variable found; the scan is broken", name)
		}
		golden(t, "env/"+name+".txt", fmt.Sprintf(envHeader, name), strings.Join(vars, "\n")+"\n")
	}
}
