package manifest_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"

	"github.com/curfew-mesh/curfew/k8s/manifest"
)

// The binaries the images ship, built once per test binary from this checkout (the
// repository's go.work) by the Dockerfiles' own build commands.
var (
	buildOnce sync.Once
	binDir    string
	buildErr  error
)

func binaries(t *testing.T) string {
	t.Helper()
	buildOnce.Do(func() {
		binDir, buildErr = os.MkdirTemp("", "curfew-k8s-bin-")
		if buildErr != nil {
			return
		}
		// Each binary is built by its Dockerfile's own go build command, so that what
		// these tests run is what the images ship.
		for _, rel := range images {
			name := filepath.Base(parseDockerfile(t, rel).entrypoint(t)[0])
			if err := buildLikeDockerfile(t, rel, filepath.Join(binDir, name)); err != nil {
				buildErr = fmt.Errorf("%s: %w", rel, err)
				return
			}
		}
	})
	if buildErr != nil {
		t.Fatal(buildErr)
	}
	return binDir
}

func TestMain(m *testing.M) {
	code := m.Run()
	if binDir != "" {
		_ = os.RemoveAll(binDir)
	}
	os.Exit(code)
}

var usageFlag = regexp.MustCompile(`(?m)^  -([a-z0-9][a-z0-9-]*)`)

// flagsOf returns the flags a service binary defines, read from its -h usage.
func flagsOf(t *testing.T, c string) map[string]bool {
	t.Helper()
	var out bytes.Buffer
	cmd := exec.Command(filepath.Join(binaries(t), c), "-h")
	cmd.Stdout, cmd.Stderr = &out, &out
	_ = cmd.Run() // -h exits 0 or 2 depending on the flag package's mode
	flags := map[string]bool{}
	for _, m := range usageFlag.FindAllStringSubmatch(out.String(), -1) {
		flags[m[1]] = true
	}
	if !flags["addr"] {
		t.Fatalf("%s -h lists no --addr flag:\n%s", c, out.String())
	}
	return flags
}

// envFlag maps CURFEW_FOO_BAR to foo-bar, the inverse of mesh/service.EnvName.
func envFlag(name string) (string, bool) {
	rest, ok := strings.CutPrefix(name, "CURFEW_")
	if !ok {
		return "", false
	}
	return strings.ToLower(strings.ReplaceAll(rest, "_", "-")), true
}

// otherEnv are the variables a manifest may set that are not curfew flags.
func otherEnv(name string) bool {
	return name == "GOMEMLIMIT" || name == "GOGC" || name == "POD_IP" || strings.HasPrefix(name, "OTEL_")
}

// Every flag a manifest passes, and every CURFEW_* variable it sets (directly or from a
// ConfigMap with envFrom), is a flag of the binary it runs; toolrunner's other variables
// are those its tools.json reads with from_env.
func TestManifestFlagsAndEnvExistInTheBinaries(t *testing.T) {
	flags := map[string]map[string]bool{}
	for _, c := range components {
		flags[c] = flagsOf(t, c)
	}
	each(t, func(t *testing.T, s *set) {
		for _, c := range components {
			ctr := container(t, s.deployments[c])
			var fromEnv map[string]bool
			if c == "toolrunner" {
				fromEnv = toolsFromEnv(toolsConfig(t, s))
			}
			for name := range flagArgs(ctr.Args) {
				if !flags[c][name] {
					t.Errorf("%s: the manifest passes --%s, which %s does not have", c, name, c)
				}
			}
			for name := range envOf(t, s, ctr, nil) {
				if f, ok := envFlag(name); ok {
					if !flags[c][f] {
						t.Errorf("%s: the manifest sets %s, but %s has no --%s", c, name, c, f)
					}
				} else if !otherEnv(name) && !fromEnv[name] {
					t.Errorf("%s: the manifest sets %s, which nothing reads", c, name)
				}
			}
		}
	})
}

// envOf returns the container's environment as the kubelet would build it from the
// rendered ConfigMaps. A secretKeyRef's value comes from secrets (nil: "<secret>").
func envOf(t *testing.T, s *set, ctr corev1.Container, secrets map[string]string) map[string]string {
	t.Helper()
	env := map[string]string{}
	for _, ef := range ctr.EnvFrom {
		if ef.ConfigMapRef == nil {
			t.Fatalf("%s: envFrom other than a ConfigMap", ctr.Name)
		}
		cm := s.configMaps[ef.ConfigMapRef.Name]
		if cm == nil {
			t.Fatalf("%s: envFrom ConfigMap %s is not in the tree", ctr.Name, ef.ConfigMapRef.Name)
		}
		for k, v := range cm.Data {
			env[ef.Prefix+k] = v
		}
	}
	for _, e := range ctr.Env {
		switch vf := e.ValueFrom; {
		case vf == nil:
			env[e.Name] = expandEnv(e.Value, env)
		case vf.ConfigMapKeyRef != nil:
			cm := s.configMaps[vf.ConfigMapKeyRef.Name]
			if cm == nil {
				t.Fatalf("%s: %s: ConfigMap %s is not in the tree", ctr.Name, e.Name, vf.ConfigMapKeyRef.Name)
			}
			v, ok := cm.Data[vf.ConfigMapKeyRef.Key]
			if !ok {
				t.Fatalf("%s: %s: ConfigMap %s has no key %s", ctr.Name, e.Name, cm.Name, vf.ConfigMapKeyRef.Key)
			}
			env[e.Name] = v
		case vf.SecretKeyRef != nil:
			env[e.Name] = "<secret>"
			if v, ok := secrets[e.Name]; ok {
				env[e.Name] = v
			}
		case vf.ResourceFieldRef != nil:
			env[e.Name] = "536870912" // limits.memory of a test process
		case vf.FieldRef != nil && vf.FieldRef.FieldPath == "status.podIP":
			env[e.Name] = podIP
		default:
			t.Fatalf("%s: %s: unsupported valueFrom", ctr.Name, e.Name)
		}
	}
	return env
}

// Each container, with the arguments, environment and policy files its manifest gives
// it, starts and becomes ready, and stops cleanly on SIGTERM within the drain bound: the
// policy ConfigMap's admission, retry and providers files pass the services' own
// validation, and no flag value is refused. Cluster endpoints are replaced by loopback
// ones: the listen addresses by free ports, the store's DSN (a Secret) by a SQLite file,
// and the NATS URL by none.
func TestManifestContainersStartWithTheirConfig(t *testing.T) {
	bin := binaries(t)
	for _, tree := range trees {
		s := render(t)[tree]
		t.Run(s.tree, func(t *testing.T) {
			t.Parallel()
			store := "sqlite://" + filepath.Join(t.TempDir(), "curfew.db")
			for _, c := range components {
				t.Run(c, func(t *testing.T) {
					t.Parallel()
					startContainer(t, s, bin, c, store)
				})
			}
		})
	}
}

func startContainer(t *testing.T, s *set, bin, c, store string) {
	d := s.deployments[c]
	ctr := container(t, d)
	root := t.TempDir()
	// The pod's volumes: ConfigMaps are written out; a Secret gets a fake key per file
	// that the policy files name under its mount.
	mounts := map[string]string{} // mountPath → local dir
	for _, vm := range ctr.VolumeMounts {
		local := filepath.Join(root, vm.Name)
		if err := os.MkdirAll(local, 0o700); err != nil {
			t.Fatal(err)
		}
		mounts[vm.MountPath] = local
		for _, v := range d.Spec.Template.Spec.Volumes {
			if v.Name == vm.Name && v.ConfigMap != nil {
				cm := s.configMaps[v.ConfigMap.Name]
				if cm == nil {
					t.Fatalf("volume %s: ConfigMap %s is not in the tree", v.Name, v.ConfigMap.Name)
				}
				for k, data := range cm.Data {
					writeFile(t, filepath.Join(local, k), data)
				}
			}
		}
	}
	var pairs []string
	for mp, local := range mounts {
		pairs = append(pairs, mp+"/", local+"/")
	}
	rewrite := strings.NewReplacer(pairs...).Replace // one pass: a local path is not rewritten again
	for mp, local := range mounts {
		for _, v := range d.Spec.Template.Spec.Volumes {
			if v.Secret == nil {
				continue
			}
			for _, vm := range ctr.VolumeMounts {
				switch {
				case vm.Name != v.Name || vm.MountPath != mp:
				case strings.HasPrefix(v.Secret.SecretName, "curfew-tls-"):
					tlsSecretFiles(t, bin, v.Secret.SecretName, local)
				default:
					fakeSecretFiles(t, mounts, mp, local)
					fakeSecretArgs(t, ctr.Args, mp, local)
				}
			}
		}
	}
	for _, local := range mounts { // the policy files name other mounts' paths
		entries, _ := os.ReadDir(local)
		for _, e := range entries {
			p := filepath.Join(local, e.Name())
			b, err := os.ReadFile(p)
			if err == nil {
				writeFile(t, p, rewrite(string(b)))
			}
		}
	}
	addr, admin := freeAddr(t), freeAddr(t)
	var args []string
	for _, a := range ctr.Args {
		switch name, _, _ := strings.Cut(strings.TrimLeft(a, "-"), "="); name {
		case "addr":
			a = "--addr=" + addr
		case "admin-addr":
			a = "--admin-addr=" + admin
		case "health-addr": // one port in every pod; here, processes side by side
			a = "--health-addr=" + freeAddr(t)
		case "console-addr":
			a = "--console-addr=" + freeAddr(t)
		}
		if name, v, ok := strings.Cut(a, "="); ok && mounts[v] != "" { // a flag naming a mount (--tls-dir)
			args = append(args, name+"="+mounts[v])
			continue
		}
		args = append(args, rewrite(a))
	}
	env := []string{"PATH=" + os.Getenv("PATH"), "HOME=" + root}
	for k, v := range envOf(t, s, ctr, map[string]string{"CURFEW_STORE": store}) {
		if k == "CURFEW_NATS" {
			continue // the cluster's broker; the tests' own is not the manifest's
		}
		env = append(env, k+"="+rewrite(v))
	}
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	var out bytes.Buffer
	cmd := exec.CommandContext(ctx, filepath.Join(bin, c), args...)
	cmd.Env, cmd.Stdout, cmd.Stderr = env, &out, &out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	if err := waitReady(ctx, "http://"+admin+"/readyz", exited); err != nil {
		_ = cmd.Process.Kill()
		t.Fatalf("%s with the manifest's config (%s): %v\nargs %q\n%s", c, s.tree, err, args, out.String())
	}
	flags := flagArgs(ctr.Args)
	drain, _ := time.ParseDuration(flags["drain-delay"])
	grace, _ := time.ParseDuration(flags["shutdown-grace"])
	if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	bound := drain + grace + stopFlush + 10*time.Second // margin for a loaded machine
	select {
	case err := <-exited:
		if err != nil {
			t.Errorf("%s exited with %v after SIGTERM, want 0\n%s", c, err, out.String())
		}
	case <-time.After(bound):
		_ = cmd.Process.Kill()
		t.Errorf("%s still running %v after SIGTERM\n%s", c, bound, out.String())
	}
}

var (
	tlsOnce    sync.Once
	tlsSecrets map[string]*corev1.Secret
	tlsErr     error
)

// tlsSecretFiles writes the files of the mesh TLS Secret name as the kubelet would mount
// them: the Secret is the one `curfew tls k8s-secrets` prints for certificates that
// `curfew tls init` made (once per test binary), so the services start with what the
// documented commands give an operator.
func tlsSecretFiles(t *testing.T, bin, name, local string) {
	t.Helper()
	tlsOnce.Do(func() {
		dir, err := os.MkdirTemp("", "curfew-k8s-tls-")
		if err != nil {
			tlsErr = err
			return
		}
		defer func() { _ = os.RemoveAll(dir) }()
		curfew := filepath.Join(bin, "curfew")
		if out, err := exec.CommandContext(t.Context(), curfew, "tls", "init", dir).CombinedOutput(); err != nil {
			tlsErr = fmt.Errorf("curfew tls init: %w\n%s", err, out)
			return
		}
		out, err := exec.CommandContext(t.Context(), curfew, "tls", "k8s-secrets", dir).Output()
		if err != nil {
			tlsErr = fmt.Errorf("curfew tls k8s-secrets: %w", err)
			return
		}
		objs, err := manifest.Decode(out)
		if err != nil {
			tlsErr = fmt.Errorf("curfew tls k8s-secrets printed what does not decode: %w", err)
			return
		}
		tlsSecrets = map[string]*corev1.Secret{}
		for _, o := range objs {
			if sec, ok := o.(*corev1.Secret); ok && sec.Namespace == "curfew" {
				tlsSecrets[sec.Name] = sec
			}
		}
	})
	if tlsErr != nil {
		t.Fatal(tlsErr)
	}
	sec := tlsSecrets[name]
	if sec == nil {
		t.Fatalf("curfew tls k8s-secrets prints no Secret %s in namespace curfew", name)
	}
	for k, v := range sec.Data {
		writeFile(t, filepath.Join(local, k), string(v))
	}
}

// fakeSecretFiles creates, under a Secret's mount, every file the other mounts' policy
// files name there, holding a made-up key.
func fakeSecretFiles(t *testing.T, mounts map[string]string, mountPath, local string) {
	t.Helper()
	re := regexp.MustCompile(regexp.QuoteMeta(mountPath+"/") + `([A-Za-z0-9._-]+)`)
	for mp, dir := range mounts {
		if mp == mountPath {
			continue
		}
		entries, _ := os.ReadDir(dir)
		for _, e := range entries {
			b, _ := os.ReadFile(filepath.Join(dir, e.Name()))
			for _, m := range re.FindAllStringSubmatch(string(b), -1) {
				writeFile(t, filepath.Join(local, m[1]), "sk-curfew-manifest-test-not-a-key\n")
			}
		}
	}
}

// fakeSecretArgs writes a fake secret for each file under mountPath that a flag names
// (--console-secret-file=/etc/curfew/console/secret), long enough for any of them.
func fakeSecretArgs(t *testing.T, args []string, mountPath, local string) {
	t.Helper()
	re := regexp.MustCompile("^--[a-z-]+=" + regexp.QuoteMeta(mountPath+"/") + `([A-Za-z0-9._-]+)$`)
	for _, a := range args {
		if m := re.FindStringSubmatch(a); m != nil {
			writeFile(t, filepath.Join(local, m[1]), "curfew-manifest-test-not-a-secret-0123456789abcdef\n")
		}
	}
}

func writeFile(t *testing.T, p, data string) {
	t.Helper()
	if err := os.WriteFile(p, []byte(data), 0o600); err != nil {
		t.Fatal(err)
	}
}

func freeAddr(t *testing.T) string {
	t.Helper()
	var lc net.ListenConfig
	l, err := lc.Listen(t.Context(), "tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = l.Close() }()
	return l.Addr().String()
}

func waitReady(ctx context.Context, url string, exited <-chan error) error {
	for {
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
		if err != nil {
			return err
		}
		if resp, err := http.DefaultClient.Do(req); err == nil {
			_ = resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return nil
			}
		}
		select {
		case err := <-exited:
			if err == nil {
				err = errors.New("exited with status 0")
			}
			return fmt.Errorf("exited before it was ready: %w", err)
		case <-ctx.Done():
			return fmt.Errorf("not ready: %w", ctx.Err())
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// runShell runs a Dockerfile RUN line with sh in dir, in the repository's workspace.
func runShell(dir, cmdline string, env ...string) error {
	cmd := exec.Command("sh", "-c", cmdline)
	cmd.Dir = dir
	cmd.Env = append(append(os.Environ(), "GOWORK="+filepath.Join(dir, "go.work")), env...)
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("%s: %w\n%s", cmdline, err, out)
	}
	return nil
}

// podIP is the pod IP the tests give the downward API's status.podIP.
const podIP = "127.0.0.1"

var envRef = regexp.MustCompile(`\$\(([A-Za-z_][A-Za-z0-9_]*)\)`)

// expandEnv expands $(VAR) references to variables defined before, as the kubelet does;
// an undefined reference stays as written.
func expandEnv(v string, env map[string]string) string {
	return envRef.ReplaceAllStringFunc(v, func(ref string) string {
		if val, ok := env[ref[2:len(ref)-1]]; ok {
			return val
		}
		return ref
	})
}
