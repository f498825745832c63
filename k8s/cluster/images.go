package cluster

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"regexp"
	"runtime"
	"slices"
	"strconv"
	"strings"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/moby/buildkit/frontend/dockerfile/instructions"
	"github.com/moby/buildkit/frontend/dockerfile/parser"
	"github.com/moby/buildkit/frontend/dockerfile/shell"
)

// The images run on the test cluster's node, which runs this machine's linux/amd64 kernel.
const (
	imageOS   = "linux"
	imageArch = "amd64"
)

// versionVar is the variable the services' Dockerfiles stamp with their VERSION build argument.
const versionVar = "github.com/curfew-mesh/curfew/mesh/service.Version"

// systemPath is the PATH of the images, as in distroless and Debian's images.
const systemPath = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

// Debian's packages that the PostgreSQL and NATS images are made of.
const (
	pgVersion  = "15"
	pgDir      = "/usr/lib/postgresql/" + pgVersion // bin and lib
	pgShare    = "/usr/share/postgresql/" + pgVersion
	natsServer = "/usr/sbin/nats-server"
	caCerts    = "/etc/ssl/certs/ca-certificates.crt"
)

// pgBinaries are the programs of pgDir/bin that the PostgreSQL image ships: the server, initdb
// (which runs postgres), and the clients the probes and the tests run.
var pgBinaries = []string{"postgres", "initdb", "pg_ctl", "pg_isready", "psql"}

// Accounts of the images' /etc/passwd and /etc/group.
var (
	nonrootAccount  = account{name: "nonroot", id: 65532, home: "/home/nonroot", mode: 0o700}
	postgresAccount = account{name: "postgres", id: 999, home: "/var/lib/postgresql", mode: 0o755}
)

// ServiceImage builds the image of one curfew service from its Dockerfile's runtime stage.
// root is the repository root; dockerfile is relative to it (e.g. "services/orchestrator/Dockerfile");
// ref is the full image reference to tag (e.g. "ghcr.io/curfew-mesh/curfew-orchestrator:v0.1.0");
// version is stamped like the Dockerfile's VERSION build-arg; out is the tarball path written.
//
// The binary is built on this machine from the root's go.work workspace, as the Dockerfile's
// build stage would; the runtime stage's base is replaced by distrolessStatic.
func ServiceImage(ctx context.Context, root, dockerfile, ref, version, out string) error {
	df, err := parseServiceDockerfile(filepath.Join(root, dockerfile), version)
	if err != nil {
		return fmt.Errorf("cluster: %s: %w", dockerfile, err)
	}
	tmp, err := os.MkdirTemp("", "curfew-image-")
	if err != nil {
		return fmt.Errorf("cluster: %w", err)
	}
	defer func() { _ = os.RemoveAll(tmp) }()
	bin := filepath.Join(tmp, path.Base(df.binary))
	// The workspace applies even when the caller runs with GOWORK=off (as go test in k8s/ does).
	work := "GOWORK="
	if _, err := os.Stat(filepath.Join(root, "go.work")); err == nil {
		work += filepath.Join(root, "go.work")
	}
	if err := goBuild(ctx, root, bin, df.pkg, "-s -w -X "+versionVar+"="+version, work); err != nil {
		return err
	}
	l := layer{}
	if err := distrolessStatic(l); err != nil {
		return err
	}
	l.copy(bin, df.binary, 0o755)
	df.config.Env = append([]string{"PATH=" + systemPath, "SSL_CERT_FILE=" + caCerts}, df.config.Env...)
	if df.config.WorkingDir == "" {
		df.config.WorkingDir = nonrootAccount.home
	}
	return writeImage(ctx, l, df.config, ref, out)
}

// PauseImage builds the sandbox ("pause") image from k8s/cluster/cmd/pause.
// Like registry.k8s.io/pause, it holds /pause alone and runs it as 65535:65535.
func PauseImage(ctx context.Context, root, ref, out string) error {
	tmp, err := os.MkdirTemp("", "curfew-image-")
	if err != nil {
		return fmt.Errorf("cluster: %w", err)
	}
	defer func() { _ = os.RemoveAll(tmp) }()
	bin := filepath.Join(tmp, "pause")
	if err := goBuild(ctx, filepath.Join(root, "k8s"), bin, "./cluster/cmd/pause", "-s -w", "GOWORK=off"); err != nil {
		return err
	}
	l := layer{}
	l.copy(bin, "/pause", 0o755)
	return writeImage(ctx, l, v1.Config{
		User:       "65535:65535",
		Entrypoint: []string{"/pause"},
		Labels:     map[string]string{"org.opencontainers.image.title": "pause"},
	}, ref, out)
}

// PostgresImage builds a PostgreSQL image from Debian's PostgreSQL 15 installed on this machine.
//
// It runs k8s/overlays/dev/postgres.yaml as the official postgres image would: its entrypoint,
// k8s/cluster/cmd/pg-entrypoint, initializes PGDATA from the POSTGRES_* variables and then
// becomes postgres; its arguments are postgres' (the image's command is "postgres").
// The image holds the server, initdb, pg_ctl, pg_isready and psql (on PATH), the server's
// modules but JIT (its LLVM alone is 110 MB, more than all the rest), its share directory,
// the time zones, every shared library they need with the dynamic loader, and /bin/sh
// (Debian's dash), which initdb runs the server with.
func PostgresImage(ctx context.Context, root, ref, out string) error {
	if err := hostPlatform(); err != nil {
		return err
	}
	tmp, err := os.MkdirTemp("", "curfew-image-")
	if err != nil {
		return fmt.Errorf("cluster: %w", err)
	}
	defer func() { _ = os.RemoveAll(tmp) }()
	entrypoint := filepath.Join(tmp, "pg-entrypoint")
	if err := goBuild(ctx, filepath.Join(root, "k8s"), entrypoint, "./cluster/cmd/pg-entrypoint", "-s -w", "GOWORK=off"); err != nil {
		return err
	}
	postgres := filepath.Join(pgDir, "bin", "postgres")
	v, err := exec.CommandContext(ctx, postgres, "--version").Output()
	if err != nil {
		return fmt.Errorf("cluster: Debian's PostgreSQL %s (postgresql-%[1]s): %s --version: %w", pgVersion, postgres, err)
	}
	version := strings.Fields(string(v)) // postgres (PostgreSQL) 15.20 (Debian 15.20-0+deb12u1)
	if len(version) < 3 {
		return fmt.Errorf("cluster: %s --version: %q", postgres, v)
	}

	l := layer{}
	if err := baseFiles(l, postgresAccount); err != nil {
		return err
	}
	l.copy(entrypoint, "/usr/local/bin/pg-entrypoint", 0o755)
	elfs := []string{"/bin/sh"}
	for _, b := range pgBinaries {
		elfs = append(elfs, filepath.Join(pgDir, "bin", b))
	}
	for _, p := range elfs {
		if err := l.addHost(p); err != nil {
			return err
		}
	}
	modules, err := l.addTree(filepath.Join(pgDir, "lib"), func(p string) bool {
		b := filepath.Base(p)
		return b == "bitcode" || b == "pgxs" || strings.HasPrefix(b, "llvmjit")
	})
	if err != nil {
		return err
	}
	for _, m := range modules {
		if strings.HasSuffix(m, ".so") {
			elfs = append(elfs, m)
		}
	}
	if _, err := l.addTree(pgShare, func(p string) bool { return p == filepath.Join(pgShare, "man") }); err != nil {
		return err
	}
	if _, err := l.addTree("/usr/share/zoneinfo", nil); err != nil {
		return err
	}
	if err := l.addLibraries(ctx, elfs...); err != nil {
		return err
	}
	pg := postgresAccount.id
	l.dir("/var/run/postgresql", 0o2775, pg, pg)
	l.dir("/var/lib/postgresql/data", 0o700, pg, pg)

	return writeImage(ctx, l, v1.Config{
		User:       fmt.Sprintf("%d:%d", pg, pg),
		Entrypoint: []string{"/usr/local/bin/pg-entrypoint"},
		Cmd:        []string{"postgres"},
		Env: []string{
			"PATH=" + systemPath + ":" + filepath.Join(pgDir, "bin"),
			"PG_MAJOR=" + pgVersion,
			"PGDATA=/var/lib/postgresql/data",
		},
		ExposedPorts: map[string]struct{}{"5432/tcp": {}},
		StopSignal:   "SIGINT", // fast shutdown, as in the official image
		Labels: map[string]string{
			"org.opencontainers.image.title":       "postgres",
			"org.opencontainers.image.version":     version[2],
			"org.opencontainers.image.description": strings.TrimSpace(string(v)),
		},
	}, ref, out)
}

// NATSImage builds a NATS image from Debian's /usr/sbin/nats-server.
// Its entrypoint is nats-server, so that k8s/overlays/dev/nats.yaml's args are its flags;
// it runs as distroless' nonroot user, 65532, and keeps JetStream's store at /data.
func NATSImage(ctx context.Context, ref, out string) error {
	if err := hostPlatform(); err != nil {
		return err
	}
	v, err := exec.CommandContext(ctx, natsServer, "--version").Output()
	if err != nil {
		return fmt.Errorf("cluster: Debian's NATS server (nats-server): %s --version: %w", natsServer, err)
	}
	version := strings.TrimPrefix(strings.TrimSpace(string(v)), "nats-server: ")
	l := layer{}
	if err := baseFiles(l, nonrootAccount); err != nil {
		return err
	}
	if err := l.addHost(natsServer); err != nil {
		return err
	}
	if err := l.addLibraries(ctx, natsServer); err != nil {
		return err
	}
	l.dir("/data", 0o700, nonrootAccount.id, nonrootAccount.id)
	return writeImage(ctx, l, v1.Config{
		User:         fmt.Sprintf("%d:%d", nonrootAccount.id, nonrootAccount.id),
		Entrypoint:   []string{natsServer},
		Env:          []string{"PATH=" + systemPath},
		ExposedPorts: map[string]struct{}{"4222/tcp": {}, "6222/tcp": {}, "8222/tcp": {}},
		Labels: map[string]string{
			"org.opencontainers.image.title":   "nats",
			"org.opencontainers.image.version": version,
		},
	}, ref, out)
}

// Import loads image tarballs into containerd's k8s.io namespace with Debian's ctr at the given socket.
// ctr unpacks each image for the default snapshotter, or for $CONTAINERD_SNAPSHOTTER when set.
func Import(ctx context.Context, ctr, socket string, tarballs ...string) error {
	for _, t := range tarballs {
		cmd := exec.CommandContext(ctx, ctr, "--address", socket, "--namespace", "k8s.io", "images", "import", t)
		if out, err := cmd.CombinedOutput(); err != nil {
			return fmt.Errorf("cluster: %s images import %s: %w\n%s", ctr, t, err, out)
		}
	}
	return nil
}

// serviceDockerfile is what ServiceImage takes from a service's Dockerfile.
type serviceDockerfile struct {
	pkg    string    // the build stage's go build package, relative to the context
	binary string    // where the runtime stage copies the binary
	config v1.Config // the runtime stage's USER, ENTRYPOINT, CMD, ENV, WORKDIR, EXPOSE and LABELs
}

// parseServiceDockerfile reads a curfew service's Dockerfile, expanding VERSION to version.
// It understands a build stage that builds the binary with go build -o, and a distroless
// static runtime stage that copies it from there and sets USER and an exec-form ENTRYPOINT;
// it fails on anything else in the runtime stage, which ServiceImage could not reproduce.
func parseServiceDockerfile(file, version string) (serviceDockerfile, error) {
	var df serviceDockerfile
	b, err := os.ReadFile(file)
	if err != nil {
		return df, err
	}
	res, err := parser.Parse(bytes.NewReader(b))
	if err != nil {
		return df, err
	}
	stages, _, err := instructions.Parse(res.AST, nil)
	if err != nil {
		return df, err
	}
	if len(stages) < 2 {
		return df, fmt.Errorf("%d stage(s); want a build stage and a runtime stage", len(stages))
	}
	final := stages[len(stages)-1]
	if !strings.HasPrefix(final.BaseName, "gcr.io/distroless/static") {
		return df, fmt.Errorf("runtime stage FROM %s: only gcr.io/distroless/static is reproduced", final.BaseName)
	}
	lex := shell.NewLex(res.EscapeToken)
	// args are the stage's build arguments: VERSION is version, the others their defaults.
	args := map[string]string{}
	declare := func(c *instructions.ArgCommand) {
		for _, a := range c.Args {
			args[a.Key] = ""
			if a.Key == "VERSION" {
				args[a.Key] = version
			} else if a.Value != nil {
				args[a.Key] = *a.Value
			}
		}
	}
	env := func() shell.EnvGetter {
		var env []string
		for k, v := range args {
			env = append(env, k+"="+v)
		}
		return shell.EnvsFromSlice(env)
	}
	expand := func(s string) (string, error) {
		r, _, err := lex.ProcessWord(s, env())
		return r, err
	}
	cfg := v1.Config{Labels: map[string]string{}, ExposedPorts: map[string]struct{}{}}
	var from, src string
	for _, c := range final.Commands {
		var err error
		switch c := c.(type) {
		case *instructions.ArgCommand:
			declare(c)
		case *instructions.LabelCommand:
			for _, kv := range c.Labels {
				if cfg.Labels[kv.Key], err = expand(kv.Value); err != nil {
					return df, fmt.Errorf("LABEL %s: %w", kv.Key, err)
				}
			}
		case *instructions.EnvCommand:
			for _, kv := range c.Env {
				v, err := expand(kv.Value)
				if err != nil {
					return df, fmt.Errorf("ENV %s: %w", kv.Key, err)
				}
				cfg.Env = append(cfg.Env, kv.Key+"="+v)
				args[kv.Key] = v
			}
		case *instructions.CopyCommand:
			if from != "" || c.From == "" || len(c.SourcePaths) != 1 || c.Chown != "" || c.Chmod != "" {
				return df, fmt.Errorf("%s: want one COPY --from=<build stage> <binary> <path>, without --chown or --chmod", c)
			}
			from, src = c.From, path.Clean(c.SourcePaths[0])
			if df.binary, err = expand(c.DestPath); err != nil {
				return df, fmt.Errorf("%s: %w", c, err)
			}
			if strings.HasSuffix(df.binary, "/") {
				df.binary += path.Base(src)
			}
			df.binary = path.Clean(df.binary)
		case *instructions.UserCommand:
			if cfg.User, err = expand(c.User); err != nil {
				return df, fmt.Errorf("%s: %w", c, err)
			}
		case *instructions.ExposeCommand:
			for _, p := range c.Ports {
				if p, err = expand(p); err != nil {
					return df, fmt.Errorf("%s: %w", c, err)
				}
				if !strings.Contains(p, "/") {
					p += "/tcp"
				}
				cfg.ExposedPorts[p] = struct{}{}
			}
		case *instructions.EntrypointCommand:
			if c.PrependShell {
				return df, fmt.Errorf("%s: shell form; the runtime image has no shell, want exec form", c)
			}
			cfg.Entrypoint = c.CmdLine
		case *instructions.CmdCommand:
			if c.PrependShell {
				return df, fmt.Errorf("%s: shell form; the runtime image has no shell, want exec form", c)
			}
			cfg.Cmd = c.CmdLine
		case *instructions.WorkdirCommand:
			if cfg.WorkingDir, err = expand(c.Path); err != nil {
				return df, fmt.Errorf("%s: %w", c, err)
			}
		default:
			return df, fmt.Errorf("%s in the runtime stage is not reproduced", c.Name())
		}
	}
	switch uid, gid, _ := strings.Cut(cfg.User, ":"); {
	case from == "":
		return df, errors.New("the runtime stage copies no binary from a build stage")
	case cfg.User == "":
		return df, errors.New("the runtime stage has no USER")
	case !isNumber(uid) || (gid != "" && !isNumber(gid)):
		return df, fmt.Errorf("USER %s: want a numeric uid[:gid]", cfg.User)
	case len(cfg.Entrypoint) == 0:
		return df, errors.New("the runtime stage has no ENTRYPOINT")
	case cfg.Entrypoint[0] != df.binary:
		return df, fmt.Errorf("ENTRYPOINT %s, but the binary is copied to %s", cfg.Entrypoint[0], df.binary)
	}

	i := slices.IndexFunc(stages, func(s instructions.Stage) bool { return s.Name == strings.ToLower(from) })
	if n, err := strconv.Atoi(from); err == nil && n >= 0 && n < len(stages)-1 {
		i = n
	}
	if i < 0 || i == len(stages)-1 {
		return df, fmt.Errorf("COPY --from=%s: no such build stage", from)
	}
	clear(args)
	for _, c := range stages[i].Commands {
		switch c := c.(type) {
		case *instructions.ArgCommand:
			declare(c)
		case *instructions.RunCommand:
			if !c.PrependShell || !strings.Contains(strings.Join(c.CmdLine, " "), "go build") {
				continue
			}
			words, err := lex.ProcessWords(strings.Join(c.CmdLine, " "), env())
			if err != nil {
				return df, fmt.Errorf("%s: %w", c, err)
			}
			out, pkg, err := parseGoBuild(words, version)
			if err != nil {
				return df, fmt.Errorf("RUN %s: %w", strings.Join(c.CmdLine, " "), err)
			}
			if path.Clean(out) == src {
				df.pkg = pkg
			}
		}
	}
	if df.pkg == "" {
		return df, fmt.Errorf("stage %s has no go build -o %s", from, src)
	}
	df.config = cfg
	return df, nil
}

// parseGoBuild returns the output and package of a go build command line (split into words,
// variables expanded), and checks that it builds what ServiceImage builds: a static, trimmed
// binary with versionVar set to version.
func parseGoBuild(words []string, version string) (out, pkg string, err error) {
	i := slices.Index(words, "go")
	if i < 0 || i+1 >= len(words) || words[i+1] != "build" {
		return "", "", errors.New("not one go build command")
	}
	if !slices.Contains(words[:i], "CGO_ENABLED=0") {
		return "", "", errors.New("go build without CGO_ENABLED=0")
	}
	var trimpath, stamped bool
	build := words[i+2:]
	for j := 0; j < len(build); j++ {
		switch w := build[j]; {
		case w == "-trimpath":
			trimpath = true
		case w == "-o" || w == "-ldflags":
			if j+1 == len(build) {
				return "", "", fmt.Errorf("%s without a value", w)
			}
			j++
			if w == "-o" {
				out = build[j]
			} else {
				stamped = strings.Contains(" "+build[j]+" ", " -X "+versionVar+"="+version+" ")
			}
		case strings.HasPrefix(w, "-"):
			return "", "", fmt.Errorf("go build flag %s is not reproduced", w)
		case pkg != "":
			return "", "", fmt.Errorf("go build of more than one package: %s, %s", pkg, w)
		default:
			pkg = w
		}
	}
	switch {
	case out == "" || pkg == "":
		return "", "", errors.New("want go build -o <binary> <package>")
	case !trimpath:
		return "", "", errors.New("go build without -trimpath")
	case !stamped:
		return "", "", fmt.Errorf("go build does not set %s to ${VERSION} with -ldflags -X", versionVar)
	}
	return out, pkg, nil
}

// goBuild builds a static linux/amd64 binary of pkg into out, in dir, with the extra environment env.
func goBuild(ctx context.Context, dir, out, pkg, ldflags string, env ...string) error {
	cmd := exec.CommandContext(ctx, "go", "build", "-trimpath", "-ldflags", ldflags, "-o", out, pkg)
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0", "GOOS="+imageOS, "GOARCH="+imageArch)
	cmd.Env = append(cmd.Env, env...)
	if b, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("cluster: go build %s in %s: %w\n%s", pkg, dir, err, b)
	}
	return nil
}

// hostPlatform fails unless this machine's binaries can run in the images.
func hostPlatform() error {
	if runtime.GOOS != imageOS || runtime.GOARCH != imageArch {
		return fmt.Errorf("cluster: images are %s/%s; this machine's binaries are %s/%s", imageOS, imageArch, runtime.GOOS, runtime.GOARCH)
	}
	return nil
}

// loader is the dynamic loader of this machine's (and the images') amd64 binaries.
const loader = "/lib64/ld-linux-x86-64.so.2"

// lddPath matches the paths of the libraries in ldd's output: "libc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x...)",
// and the dynamic loader's "/lib64/ld-linux-x86-64.so.2 (0x...)".
var lddPath = regexp.MustCompile(`(?m)(?:=>|^)\s*(/\S+) \(0x[0-9a-f]+\)$`)

// addLibraries adds every shared library the ELF files need, with the dynamic loader, at the paths
// ldd finds them at, through the same symbolic links as on this machine. It runs what ldd runs
// for each file, the loader's --list: the ldd script itself takes 90 ms a file, and PostgreSQL's
// modules are a hundred.
func (l layer) addLibraries(ctx context.Context, elfs ...string) error {
	for _, f := range elfs {
		out, err := exec.CommandContext(ctx, loader, "--list", f).CombinedOutput()
		if err != nil {
			return fmt.Errorf("cluster: ldd %s (%s --list): %w\n%s", f, loader, err, out)
		}
		if bytes.Contains(out, []byte("not found")) {
			return fmt.Errorf("cluster: ldd %s: missing libraries:\n%s", f, out)
		}
		for _, m := range lddPath.FindAllSubmatch(out, -1) {
			if err := l.addHost(string(m[1])); err != nil {
				return err
			}
		}
	}
	return nil
}

func isNumber(s string) bool {
	_, err := strconv.ParseUint(s, 10, 32)
	return err == nil
}
