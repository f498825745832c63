package cluster_test

import (
	"archive/tar"
	"bytes"
	"context"
	"debug/elf"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"github.com/moby/buildkit/frontend/dockerfile/instructions"
	"github.com/moby/buildkit/frontend/dockerfile/parser"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"sigs.k8s.io/yaml"

	"github.com/curfew-mesh/curfew/k8s/cluster"
)

// imagesTestVersion is the VERSION the service images are built with.
const imagesTestVersion = "v0.0.0-cluster-images-test"

// Debian's programs the PostgreSQL and NATS images are made of.
const (
	imagesPostgres = "/usr/lib/postgresql/15/bin/postgres"
	imagesNATS     = "/usr/sbin/nats-server"
)

// imagesNeedHost skips the test unless it runs as root (it mounts, chroots and changes user)
// and the machine has the programs; under CI=true a missing program fails it.
func imagesNeedHost(t *testing.T, programs ...string) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root: runs the image with unshare, mount and chroot")
	}
	for _, p := range programs {
		if _, err := exec.LookPath(p); err != nil {
			if os.Getenv("CI") == "true" {
				t.Fatalf("CI=true: %v", err)
			}
			t.Skipf("%v (Debian's postgresql-15, nats-server, containerd, curl and util-linux)", err)
		}
	}
}

// imagesRead reads the image tarball, which must be tagged ref, and calls file with each entry
// of its single layer.
func imagesRead(t *testing.T, path, ref string, file func(h *tar.Header, r io.Reader)) *v1.ConfigFile {
	t.Helper()
	tag, err := name.NewTag(ref)
	if err != nil {
		t.Fatal(err)
	}
	img, err := tarball.ImageFromPath(path, &tag)
	if err != nil {
		t.Fatal(err)
	}
	cf, err := img.ConfigFile()
	if err != nil {
		t.Fatal(err)
	}
	if cf.OS != "linux" || cf.Architecture != "amd64" {
		t.Errorf("platform %s/%s, want linux/amd64", cf.OS, cf.Architecture)
	}
	layers, err := img.Layers()
	if err != nil || len(layers) != 1 {
		t.Fatalf("%d layers (%v), want 1", len(layers), err)
	}
	rc, err := layers[0].Uncompressed()
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = rc.Close() }()
	tr := tar.NewReader(rc)
	for {
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			return cf
		}
		if err != nil {
			t.Fatal(err)
		}
		file(h, tr)
	}
}

// imagesStatic fails unless bin is a static ELF executable.
func imagesStatic(t *testing.T, name string, bin []byte) {
	t.Helper()
	f, err := elf.NewFile(bytes.NewReader(bin))
	if err != nil {
		t.Fatalf("%s: %v", name, err)
	}
	for _, p := range f.Progs {
		if p.Type == elf.PT_INTERP {
			t.Errorf("%s is dynamically linked (has an ELF interpreter)", name)
		}
	}
}

// imagesRuntimeStage is what a service's Dockerfile's final stage says the image runs.
type imagesRuntimeStage struct {
	user       string
	entrypoint []string
	ports      map[string]struct{}
}

func imagesParseRuntimeStage(t *testing.T, dockerfile string) imagesRuntimeStage {
	t.Helper()
	b, err := os.ReadFile(dockerfile)
	if err != nil {
		t.Fatal(err)
	}
	res, err := parser.Parse(bytes.NewReader(b))
	if err != nil {
		t.Fatal(err)
	}
	stages, _, err := instructions.Parse(res.AST, nil)
	if err != nil {
		t.Fatal(err)
	}
	rs := imagesRuntimeStage{ports: map[string]struct{}{}}
	for _, c := range stages[len(stages)-1].Commands {
		switch c := c.(type) {
		case *instructions.UserCommand:
			rs.user = c.User
		case *instructions.EntrypointCommand:
			rs.entrypoint = c.CmdLine
		case *instructions.ExposeCommand:
			for _, p := range c.Ports {
				rs.ports[p+"/tcp"] = struct{}{}
			}
		}
	}
	if rs.user == "" || len(rs.entrypoint) == 0 || len(rs.ports) == 0 {
		t.Fatalf("%s: runtime stage without USER, ENTRYPOINT or EXPOSE: %+v", dockerfile, rs)
	}
	return rs
}

// The service images run what the Dockerfiles' runtime stages say, as a numeric non-root user,
// a static binary stamped with the version, on a root that a read-only mount takes nothing from.
func TestServiceImages(t *testing.T) {
	root := repoRoot(t)
	for _, svc := range []string{"orchestrator", "toolrunner", "subagent", "modelproxy"} {
		t.Run(svc, func(t *testing.T) {
			t.Parallel()
			rel := filepath.Join("services", svc, "Dockerfile")
			want := imagesParseRuntimeStage(t, filepath.Join(root, rel))
			ref := "ghcr.io/curfew-mesh/curfew-" + svc + ":" + imagesTestVersion
			out := filepath.Join(t.TempDir(), svc+".tar")
			if err := cluster.ServiceImage(t.Context(), root, rel, ref, imagesTestVersion, out); err != nil {
				t.Fatal(err)
			}
			files := map[string]*tar.Header{}
			var bin, passwd []byte
			cf := imagesRead(t, out, ref, func(h *tar.Header, r io.Reader) {
				p := "/" + strings.TrimSuffix(h.Name, "/")
				files[p] = h
				switch p {
				case want.entrypoint[0]:
					bin, _ = io.ReadAll(r)
				case "/etc/passwd":
					passwd, _ = io.ReadAll(r)
				}
			})
			c := cf.Config
			if c.User != want.user {
				t.Errorf("user %q, want the Dockerfile's %q", c.User, want.user)
			}
			if !slices.Equal(c.Entrypoint, want.entrypoint) {
				t.Errorf("entrypoint %q, want the Dockerfile's %q", c.Entrypoint, want.entrypoint)
			}
			if !maps.Equal(c.ExposedPorts, want.ports) {
				t.Errorf("exposed ports %v, want the Dockerfile's %v", slices.Sorted(maps.Keys(c.ExposedPorts)), slices.Sorted(maps.Keys(want.ports)))
			}
			if v := c.Labels["org.opencontainers.image.version"]; v != imagesTestVersion {
				t.Errorf("version label %q, want %q", v, imagesTestVersion)
			}
			uid, gid, _ := strings.Cut(c.User, ":")
			if n, err := strconv.Atoi(uid); err != nil || n == 0 {
				t.Errorf("user %q: want a numeric non-root uid (runAsNonRoot can only check a number)", c.User)
			}
			if _, err := strconv.Atoi(gid); err != nil {
				t.Errorf("user %q: want a numeric gid", c.User)
			}

			switch h := files[want.entrypoint[0]]; {
			case h == nil:
				t.Fatalf("no %s in the image", want.entrypoint[0])
			case h.Typeflag != tar.TypeReg || h.Mode&0o005 != 0o005:
				t.Errorf("%s: type %c mode %o; want a file any user may run", h.Name, h.Typeflag, h.Mode)
			}
			imagesStatic(t, want.entrypoint[0], bin)
			if !bytes.Contains(bin, []byte(imagesTestVersion)) {
				t.Errorf("%s does not carry VERSION %s", want.entrypoint[0], imagesTestVersion)
			}
			for p, h := range files {
				if h.Typeflag != tar.TypeSymlink && h.Mode&0o002 != 0 && p != "/tmp" {
					t.Errorf("%s is writable by anyone (mode %o); a read-only root would take that away", p, h.Mode)
				}
			}
			home := ""
			for line := range strings.Lines(string(passwd)) {
				if f := strings.Split(line, ":"); len(f) == 7 && f[2] == uid {
					home = f[5]
				}
			}
			if h := files[home]; home == "" || h == nil || strconv.Itoa(h.Uid) != uid {
				t.Errorf("uid %s has no home it owns in /etc/passwd:\n%s", uid, passwd)
			}
			if files["/etc/ssl/certs/ca-certificates.crt"] == nil || files["/tmp"] == nil || files["/tmp"].Mode != 0o1777 {
				t.Error("no CA certificates, or no /tmp with mode 1777")
			}
		})
	}
}

// ServiceImage fails, before building anything, on a Dockerfile whose runtime it could not reproduce.
func TestServiceImageRejects(t *testing.T) {
	b, err := os.ReadFile(filepath.Join(repoRoot(t), "services/orchestrator/Dockerfile"))
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct{ name, old, new, want string }{
		{"no USER", "USER 65532:65532\n", "", "no USER"},
		{"user name", "USER 65532:65532", "USER nonroot", "numeric"},
		{"shell-form ENTRYPOINT", `ENTRYPOINT ["/usr/local/bin/orchestrator"]`, "ENTRYPOINT /usr/local/bin/orchestrator", "exec form"},
		{"RUN in the runtime stage", "EXPOSE 7700 7701", "RUN true\nEXPOSE 7700 7701", "run in the runtime stage"},
		{"another base", "FROM gcr.io/distroless/static-debian12:nonroot", "FROM debian:12", "distroless"},
		{"no VERSION stamp", "-X github.com/curfew-mesh/curfew/mesh/service.Version=${VERSION}", "", "VERSION"},
		{"cgo", "CGO_ENABLED=0 go build", "go build", "CGO_ENABLED=0"},
		{"another binary", "COPY --from=build /out/orchestrator", "COPY --from=build /out/other", "no go build -o /out/other"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			df := strings.Replace(string(b), tc.old, tc.new, 1)
			if df == string(b) {
				t.Fatalf("the Dockerfile has no %q", tc.old)
			}
			root := t.TempDir()
			if err := os.WriteFile(filepath.Join(root, "Dockerfile"), []byte(df), 0o600); err != nil {
				t.Fatal(err)
			}
			err := cluster.ServiceImage(t.Context(), root, "Dockerfile", "example.com/x:v1", "v1", filepath.Join(root, "x.tar"))
			if err == nil || !strings.Contains(strings.ToLower(err.Error()), strings.ToLower(tc.want)) {
				t.Errorf("error %v; want one about %q", err, tc.want)
			}
		})
	}
}

// The pause image is /pause alone, static, run as 65535; pause blocks until SIGTERM and exits 0,
// and as PID 1 it reaps the orphans that exit.
func TestPauseImage(t *testing.T) {
	t.Parallel()
	ref := "registry.k8s.io/pause:3.10"
	out := filepath.Join(t.TempDir(), "pause.tar")
	if err := cluster.PauseImage(t.Context(), repoRoot(t), ref, out); err != nil {
		t.Fatal(err)
	}
	var names []string
	var bin []byte
	cf := imagesRead(t, out, ref, func(h *tar.Header, r io.Reader) {
		names = append(names, h.Name)
		bin, _ = io.ReadAll(r)
	})
	if !slices.Equal(names, []string{"pause"}) || !slices.Equal(cf.Config.Entrypoint, []string{"/pause"}) || cf.Config.User != "65535:65535" {
		t.Fatalf("files %q, entrypoint %q, user %q; want /pause alone, run as 65535:65535", names, cf.Config.Entrypoint, cf.Config.User)
	}
	imagesStatic(t, "/pause", bin)
	pause := filepath.Join(t.TempDir(), "pause")
	if err := os.WriteFile(pause, bin, 0o755); err != nil {
		t.Fatal(err)
	}

	proc := imagesStart(t, exec.Command(pause))
	time.Sleep(200 * time.Millisecond)
	select {
	case <-proc.exited:
		t.Fatalf("pause exited at once: %v", proc.err)
	default:
	}
	if err := proc.stop(proc.cmd.Process.Pid, syscall.SIGTERM, 10*time.Second); err != nil {
		t.Errorf("on SIGTERM: %v; want exit 0", err)
	}

	t.Run("reaps", func(t *testing.T) {
		imagesNeedHost(t, "unshare", "nsenter", "sh")
		proc := imagesStart(t, exec.Command("unshare", "--pid", "--fork", "--kill-child", pause))
		pid := imagesChild(t, proc.cmd.Process.Pid)
		// sh's children outlive it: they are given to the namespace's PID 1, pause.
		sh := exec.Command("nsenter", "-t", strconv.Itoa(pid), "-p", "sh", "-c", "sleep 0.2 & sleep 0.2 & exit 0")
		if b, err := sh.CombinedOutput(); err != nil {
			t.Fatalf("%v: %s", err, b)
		}
		var children []byte
		for end := time.Now().Add(5 * time.Second); time.Now().Before(end); time.Sleep(100 * time.Millisecond) {
			if children, _ = os.ReadFile(fmt.Sprintf("/proc/%d/task/%[1]d/children", pid)); len(bytes.TrimSpace(children)) == 0 {
				break
			}
		}
		if len(bytes.TrimSpace(children)) > 0 {
			t.Errorf("pause did not reap its children %s", children)
		}
		if err := proc.stop(pid, syscall.SIGTERM, 10*time.Second); err != nil {
			t.Errorf("on SIGTERM: %v; want exit 0", err)
		}
	})
}

// imagesProc is a process a test started.
type imagesProc struct {
	cmd    *exec.Cmd
	exited chan struct{} // closed when it has exited, and err is Wait's
	err    error
}

// imagesStart starts cmd; the test's end kills it.
func imagesStart(t *testing.T, cmd *exec.Cmd) *imagesProc {
	t.Helper()
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	p := &imagesProc{cmd: cmd, exited: make(chan struct{})}
	go func() {
		p.err = cmd.Wait()
		close(p.exited)
	}()
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		<-p.exited
	})
	return p
}

// stop sends pid (the process, or its child) sig and waits for the process to exit, killing it
// after timeout.
func (p *imagesProc) stop(pid int, sig syscall.Signal, timeout time.Duration) error {
	_ = syscall.Kill(pid, sig)
	select {
	case <-p.exited:
		return p.err
	case <-time.After(timeout):
		_ = p.cmd.Process.Kill()
		<-p.exited
		return fmt.Errorf("did not exit in %v after %v", timeout, sig)
	}
}

// imagesChild returns the process pid forked (unshare --fork's child: its namespace's PID 1).
func imagesChild(t *testing.T, pid int) int {
	t.Helper()
	for end := time.Now().Add(5 * time.Second); time.Now().Before(end); time.Sleep(20 * time.Millisecond) {
		b, _ := os.ReadFile(fmt.Sprintf("/proc/%d/task/%[1]d/children", pid))
		if f := strings.Fields(string(b)); len(f) > 0 {
			n, err := strconv.Atoi(f[0])
			if err != nil {
				t.Fatal(err)
			}
			return n
		}
	}
	t.Fatalf("process %d forked no child", pid)
	return 0
}

// imagesUnpack extracts the image tarball's layer into dir, owners and modes as in the layer.
func imagesUnpack(t *testing.T, path, ref, dir string) *v1.ConfigFile {
	t.Helper()
	return imagesRead(t, path, ref, func(h *tar.Header, r io.Reader) {
		if !filepath.IsLocal(h.Name) {
			t.Fatalf("layer entry %q outside the root", h.Name)
		}
		p := filepath.Join(dir, h.Name)
		var err error
		switch h.Typeflag {
		case tar.TypeDir:
			err = os.MkdirAll(p, 0o700)
		case tar.TypeSymlink:
			err = os.Symlink(h.Linkname, p)
		case tar.TypeReg:
			var f *os.File
			if f, err = os.OpenFile(p, os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o600); err == nil {
				_, err = io.Copy(f, r)
				err = errors.Join(err, f.Close())
			}
		default:
			err = fmt.Errorf("type %c", h.Typeflag)
		}
		if err == nil {
			err = os.Lchown(p, h.Uid, h.Gid)
		}
		if err == nil && h.Typeflag != tar.TypeSymlink {
			err = os.Chmod(p, h.FileInfo().Mode()&(fs.ModePerm|fs.ModeSetuid|fs.ModeSetgid|fs.ModeSticky))
		}
		if err != nil {
			t.Fatalf("%s: %v", h.Name, err)
		}
	})
}

// imagesStatefulSet reads the StatefulSet of a manifest of the repository.
func imagesStatefulSet(t *testing.T, rel string) *appsv1.StatefulSet {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(repoRoot(t), rel))
	if err != nil {
		t.Fatal(err)
	}
	for doc := range strings.SplitSeq(string(b), "\n---\n") {
		var sts appsv1.StatefulSet
		if err := yaml.Unmarshal([]byte(doc), &sts); err != nil {
			t.Fatalf("%s: %v", rel, err)
		}
		if sts.Kind == "StatefulSet" && len(sts.Spec.Template.Spec.Containers) == 1 {
			return &sts
		}
	}
	t.Fatalf("%s: no StatefulSet of one container", rel)
	return nil
}

// imagesPod runs an unpacked image as the kubelet and containerd would run a StatefulSet's
// container: its command, args and env over the image's, its user and fsGroup, its root read-only
// as it asks, an emptyDir as a fresh tmpfs, a volume claim as a directory of data (which
// outlives the pod), in mount, PID and network namespaces of its own (so that its ports are free).
type imagesPod struct {
	t      *testing.T
	rootfs string
	env    []string
	chroot []string // chroot --userspec --groups rootfs
	proc   *imagesProc
	pid    int // the container's PID 1, seen from here
	log    imagesLog
}

// imagesLog is a pod's output.
type imagesLog struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (l *imagesLog) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.buf.Write(p)
}

func (l *imagesLog) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.buf.String()
}

func imagesRunPod(t *testing.T, rootfs string, cf *v1.ConfigFile, sts *appsv1.StatefulSet, data string) *imagesPod {
	t.Helper()
	spec := sts.Spec.Template.Spec
	c := spec.Containers[0]
	p := &imagesPod{t: t, rootfs: rootfs}

	argv := c.Command
	if len(argv) == 0 {
		argv = slices.Concat(cf.Config.Entrypoint, cf.Config.Cmd)
		if len(c.Args) > 0 {
			argv = slices.Concat(cf.Config.Entrypoint, c.Args)
		}
	} else {
		argv = slices.Concat(argv, c.Args)
	}
	env := map[string]string{}
	for _, kv := range cf.Config.Env {
		k, v, _ := strings.Cut(kv, "=")
		env[k] = v
	}
	for _, e := range c.Env {
		if e.ValueFrom != nil {
			t.Fatalf("env %s: valueFrom is not supported here", e.Name)
		}
		env[e.Name] = e.Value
	}
	for k, v := range env {
		p.env = append(p.env, k+"="+v)
	}

	uid, gid, _ := strings.Cut(cf.Config.User, ":")
	sc := corev1.SecurityContext{}
	if ps := spec.SecurityContext; ps != nil {
		sc.RunAsUser, sc.RunAsGroup = ps.RunAsUser, ps.RunAsGroup
	}
	if c.SecurityContext != nil {
		if c.SecurityContext.RunAsUser != nil {
			sc.RunAsUser = c.SecurityContext.RunAsUser
		}
		if c.SecurityContext.RunAsGroup != nil {
			sc.RunAsGroup = c.SecurityContext.RunAsGroup
		}
		sc.ReadOnlyRootFilesystem = c.SecurityContext.ReadOnlyRootFilesystem
	}
	if sc.RunAsUser != nil {
		uid = strconv.FormatInt(*sc.RunAsUser, 10)
	}
	if sc.RunAsGroup != nil {
		gid = strconv.FormatInt(*sc.RunAsGroup, 10)
	}
	fsGroup := "0"
	p.chroot = []string{"chroot", "--userspec=" + uid + ":" + gid}
	if spec.SecurityContext != nil && spec.SecurityContext.FSGroup != nil {
		fsGroup = strconv.FormatInt(*spec.SecurityContext.FSGroup, 10)
		p.chroot = append(p.chroot, "--groups="+fsGroup)
	}
	p.chroot = append(p.chroot, rootfs)

	q := func(s string) string { return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'" }
	script := []string{"set -e", "mount --bind " + q(rootfs) + " " + q(rootfs)}
	mount := func(opts, src, dir string) {
		if err := os.MkdirAll(filepath.Join(rootfs, dir), 0o755); err != nil {
			t.Fatal(err)
		}
		script = append(script, "mount "+opts+" "+q(src)+" "+q(filepath.Join(rootfs, dir)))
	}
	mount("--rbind", "/dev", "/dev")
	mount("-t proc", "proc", "/proc")
	for _, m := range c.VolumeMounts {
		switch {
		case slices.ContainsFunc(sts.Spec.VolumeClaimTemplates, func(v corev1.PersistentVolumeClaim) bool { return v.Name == m.Name }):
			dir := filepath.Join(data, m.Name)
			if err := os.MkdirAll(dir, 0o755); err != nil {
				t.Fatal(err)
			}
			g, _ := strconv.Atoi(fsGroup)
			if err := errors.Join(os.Chown(dir, 0, g), os.Chmod(dir, 0o775|fs.ModeSetgid)); err != nil {
				t.Fatal(err)
			}
			mount("--bind", dir, m.MountPath)
		case slices.ContainsFunc(spec.Volumes, func(v corev1.Volume) bool { return v.Name == m.Name && v.EmptyDir != nil }):
			mount("-t tmpfs -o mode=2777,gid="+fsGroup, "tmpfs", m.MountPath)
		default:
			t.Fatalf("volume %s: only emptyDir and volume claims are supported here", m.Name)
		}
	}
	if sc.ReadOnlyRootFilesystem != nil && *sc.ReadOnlyRootFilesystem {
		script = append(script, "mount -o remount,bind,ro "+q(rootfs))
	}
	script = append(script, "ip link set lo up", "exec "+strings.Join(slices.Collect(func(yield func(string) bool) {
		for _, a := range slices.Concat(p.chroot, argv) {
			if !yield(q(a)) {
				return
			}
		}
	}), " "))

	// Killing unshare kills its child (--kill-child), the namespace's PID 1, and the kernel the rest.
	cmd := exec.Command("unshare", "--mount", "--net", "--pid", "--fork", "--kill-child", "sh", "-c", strings.Join(script, "\n"))
	cmd.Env = p.env
	cmd.Stdout, cmd.Stderr = &p.log, &p.log
	p.proc = imagesStart(t, cmd)
	p.pid = imagesChild(t, cmd.Process.Pid)
	return p
}

// exec runs argv in the pod's container (its mounts, network, root and user), as a probe would.
func (p *imagesPod) exec(ctx context.Context, argv ...string) ([]byte, error) {
	cmd := exec.CommandContext(ctx, "nsenter", slices.Concat([]string{"-t", strconv.Itoa(p.pid), "-m", "-n", "--"}, p.chroot, argv)...)
	cmd.Env = p.env
	return cmd.CombinedOutput()
}

// probe runs the probe as the kubelet would: an exec in the container, or an HTTP GET of its address.
func (p *imagesPod) probe(ctx context.Context, c corev1.Container, pr *corev1.Probe) error {
	var b []byte
	var err error
	switch {
	case pr.Exec != nil:
		b, err = p.exec(ctx, pr.Exec.Command...)
	case pr.HTTPGet != nil:
		port := pr.HTTPGet.Port.IntValue()
		for _, cp := range c.Ports {
			if cp.Name == pr.HTTPGet.Port.String() {
				port = int(cp.ContainerPort)
			}
		}
		url := fmt.Sprintf("http://127.0.0.1:%d%s", port, pr.HTTPGet.Path)
		b, err = exec.CommandContext(ctx, "nsenter", "-t", strconv.Itoa(p.pid), "-n", "--", "curl", "-fsS", url).CombinedOutput()
	default:
		return fmt.Errorf("probe %+v is not supported here", pr.ProbeHandler)
	}
	if err != nil {
		return fmt.Errorf("%w: %s", err, b)
	}
	return nil
}

// ready waits until the container's readiness and liveness probes succeed.
func (p *imagesPod) ready(c corev1.Container) {
	p.t.Helper()
	var err error
	for end := time.Now().Add(45 * time.Second); time.Now().Before(end); time.Sleep(200 * time.Millisecond) {
		select {
		case <-p.proc.exited:
			p.t.Fatalf("the container exited: %v\n%s", p.proc.err, p.log.String())
		default:
		}
		ctx, cancel := context.WithTimeout(p.t.Context(), 5*time.Second)
		err = errors.Join(p.probe(ctx, c, c.ReadinessProbe), p.probe(ctx, c, c.LivenessProbe))
		cancel()
		if err == nil {
			return
		}
	}
	p.t.Fatalf("not ready: %v\n%s", err, p.log.String())
}

// stop sends the container's PID 1 SIGTERM, as the kubelet does, and returns its exit.
func (p *imagesPod) stop() error {
	return p.proc.stop(p.pid, syscall.SIGTERM, 30*time.Second)
}

// The PostgreSQL image runs k8s/overlays/dev/postgres.yaml as the official image would: it
// initializes the database its env names, answers its probes and curfew's user, stops on
// SIGTERM, and starts again on the data it left.
func TestPostgresImage(t *testing.T) {
	imagesNeedHost(t, "unshare", "nsenter", "chroot", "mount", "ip", "/bin/sh", imagesPostgres)
	t.Parallel()
	ref := "docker.io/library/postgres:17.6-bookworm"
	out := filepath.Join(t.TempDir(), "postgres.tar")
	if err := cluster.PostgresImage(t.Context(), repoRoot(t), ref, out); err != nil {
		t.Fatal(err)
	}
	rootfs := t.TempDir()
	cf := imagesUnpack(t, out, ref, rootfs)
	sts := imagesStatefulSet(t, "k8s/overlays/dev/postgres.yaml")
	c := sts.Spec.Template.Spec.Containers[0]
	env := map[string]string{}
	for _, e := range c.Env {
		env[e.Name] = e.Value
	}
	data := t.TempDir()
	for run := range 2 {
		pod := imagesRunPod(t, rootfs, cf, sts, data)
		pod.ready(c)
		b, err := pod.exec(t.Context(), "psql", "-h", "127.0.0.1", "-U", env["POSTGRES_USER"], "-d", env["POSTGRES_DB"], "-tAc", "select current_user || ' ' || current_database()")
		if got := strings.TrimSpace(string(b)); err != nil || got != env["POSTGRES_USER"]+" "+env["POSTGRES_DB"] {
			t.Errorf("psql: %q, %v", got, err)
		}
		if err := pod.stop(); err != nil {
			t.Errorf("postgres on SIGTERM: %v", err)
		}
		// The first run initializes the data, the second one starts on it.
		if log := pod.log.String(); strings.Contains(log, "pg-entrypoint: created database") != (run == 0) {
			t.Errorf("run %d on the same volume: initialized %v:\n%s", run+1, run == 0, log)
		}
	}
}

// The NATS image runs k8s/overlays/dev/nats.yaml: JetStream on its volume, healthy for its probes.
func TestNATSImage(t *testing.T) {
	imagesNeedHost(t, "unshare", "nsenter", "chroot", "mount", "ip", "curl", imagesNATS)
	t.Parallel()
	ref := "docker.io/library/nats:2.11.9-alpine"
	out := filepath.Join(t.TempDir(), "nats.tar")
	if err := cluster.NATSImage(t.Context(), ref, out); err != nil {
		t.Fatal(err)
	}
	rootfs := t.TempDir()
	cf := imagesUnpack(t, out, ref, rootfs)
	sts := imagesStatefulSet(t, "k8s/overlays/dev/nats.yaml")
	data := t.TempDir()
	pod := imagesRunPod(t, rootfs, cf, sts, data)
	pod.ready(sts.Spec.Template.Spec.Containers[0])
	// nats-server exits 1 on SIGTERM (0 on SIGINT), the official image's too: only its stopping counts.
	if err := pod.stop(); err != nil && !strings.Contains(pod.log.String(), "Server Exiting..") {
		t.Errorf("nats-server on SIGTERM: %v\n%s", err, pod.log.String())
	}
	if _, err := os.Stat(filepath.Join(data, "data", "jetstream")); err != nil {
		t.Errorf("JetStream did not store on the volume: %v", err)
	}
}

// Import loads images into containerd's k8s.io namespace, unpacked: containerd (runc) runs the
// pause image as its user, and it stops on SIGTERM.
func TestImport(t *testing.T) {
	imagesNeedHost(t, "containerd", "ctr", "runc")
	t.Parallel()
	dir := t.TempDir()
	sock := filepath.Join(dir, "containerd.sock")
	config := fmt.Sprintf(`version = 2
root = %q
state = %q
disabled_plugins = ["io.containerd.grpc.v1.cri", "io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.devmapper"]
[grpc]
  address = %q
[ttrpc]
  address = %q
[plugins."io.containerd.internal.v1.opt"]
  path = %q
`, filepath.Join(dir, "root"), filepath.Join(dir, "state"), sock, sock+".ttrpc", filepath.Join(dir, "opt"))
	if err := os.WriteFile(filepath.Join(dir, "config.toml"), []byte(config), 0o600); err != nil {
		t.Fatal(err)
	}
	var log imagesLog
	containerd := exec.Command("containerd", "--config", filepath.Join(dir, "config.toml"))
	containerd.Stdout, containerd.Stderr = &log, &log
	proc := imagesStart(t, containerd)
	t.Cleanup(func() { _ = proc.stop(containerd.Process.Pid, syscall.SIGTERM, 10*time.Second) })
	ctr := func(args ...string) ([]byte, error) {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second) // also in cleanups
		defer cancel()
		return exec.CommandContext(ctx, "ctr", slices.Concat([]string{"--address", sock, "--namespace", "k8s.io"}, args)...).CombinedOutput()
	}
	for end := time.Now().Add(10 * time.Second); ; time.Sleep(100 * time.Millisecond) {
		if _, err := ctr("version"); err == nil {
			break
		} else if time.Now().After(end) {
			t.Fatalf("containerd: %v\n%s", err, log.String())
		}
	}

	ref := "registry.k8s.io/pause:3.10"
	out := filepath.Join(t.TempDir(), "pause.tar")
	if err := cluster.PauseImage(t.Context(), repoRoot(t), ref, out); err != nil {
		t.Fatal(err)
	}
	if err := cluster.Import(t.Context(), "ctr", sock, out); err != nil {
		t.Fatal(err)
	}
	if b, err := ctr("images", "ls", "-q"); err != nil || !slices.Contains(strings.Fields(string(b)), ref) {
		t.Fatalf("ctr images ls: %s %v; want %s", b, err, ref)
	}

	id := fmt.Sprintf("curfew-images-test-%d", os.Getpid())
	run := exec.Command("ctr", "--address", sock, "--namespace", "k8s.io", "run", "--rm", ref, id)
	var runLog imagesLog
	run.Stdout, run.Stderr = &runLog, &runLog
	ran := imagesStart(t, run)
	t.Cleanup(func() { // after a failure: no container may outlive containerd, nor its shim
		_, _ = ctr("task", "delete", "--force", id)
		_, _ = ctr("containers", "delete", id)
	})
	var pid string
	for end := time.Now().Add(20 * time.Second); pid == ""; time.Sleep(100 * time.Millisecond) {
		b, _ := ctr("task", "ls")
		for line := range strings.Lines(string(b)) {
			if f := strings.Fields(line); len(f) == 3 && f[0] == id && f[2] == "RUNNING" {
				pid = f[1]
			}
		}
		if time.Now().After(end) {
			t.Fatalf("the pause container did not run:\n%s", runLog.String())
		}
	}
	status, err := os.ReadFile("/proc/" + pid + "/status")
	if err != nil || !strings.Contains(string(status), "\nUid:\t65535\t") {
		t.Errorf("pause runs as %v:\n%s", err, status)
	}
	if b, err := ctr("task", "kill", id); err != nil {
		t.Fatalf("ctr task kill: %v: %s", err, b)
	}
	select {
	case <-ran.exited:
		if ran.err != nil {
			t.Errorf("pause on SIGTERM: %v\n%s", ran.err, runLog.String())
		}
	case <-time.After(20 * time.Second):
		t.Errorf("pause did not stop on SIGTERM:\n%s", runLog.String())
	}
}
