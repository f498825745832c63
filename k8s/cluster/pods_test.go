package cluster_test

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sync/errgroup"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/curfew-mesh/curfew/k8s/cluster"
	"github.com/curfew-mesh/curfew/k8s/manifest"
)

// The images the test builds, named as the dev overlay names them but for the tag (and for
// PostgreSQL and NATS, the name: they are built from Debian's binaries, see PostgresImage).
const (
	testTag       = "cluster-test-1"
	postgresImage = "curfew.test/postgres:15-debian12"
	natsImage     = "curfew.test/nats:2.9.10-debian12"
)

// services maps each curfew Deployment's image to its Dockerfile.
var services = map[string]string{
	"ghcr.io/curfew-mesh/curfew-orchestrator": "services/orchestrator/Dockerfile",
	"ghcr.io/curfew-mesh/curfew-toolrunner":   "services/toolrunner/Dockerfile",
	"ghcr.io/curfew-mesh/curfew-subagent":     "services/subagent/Dockerfile",
	"ghcr.io/curfew-mesh/curfew-modelproxy":   "services/modelproxy/Dockerfile",
}

// requireCluster returns the options for cluster.Start, or skips the test when this
// machine cannot run the cluster; under CI=true a missing piece fails instead, so that CI
// never passes by skipping.
func requireCluster(t *testing.T) cluster.Options {
	t.Helper()
	if testing.Short() {
		t.Skip("the one-node cluster takes minutes: not in -short")
	}
	var missing []string
	for _, env := range []string{cluster.EnvNode, cluster.EnvCoreDNS, "CURFEW_KUBE_APISERVER", "CURFEW_ETCD"} {
		if os.Getenv(env) == "" {
			missing = append(missing, env)
		}
	}
	for _, bin := range []string{"/usr/bin/containerd", "/usr/bin/runc", "/usr/lib/cni/bridge", "/usr/sbin/iptables"} {
		if _, err := os.Stat(bin); err != nil {
			missing = append(missing, bin)
		}
	}
	if os.Geteuid() != 0 {
		missing = append(missing, "root")
	}
	if len(missing) > 0 {
		msg := "the one-node cluster needs " + strings.Join(missing, ", ") + " (scripts/test.sh's cluster step sets them up)"
		if os.Getenv("CI") == "true" {
			t.Fatal(msg)
		}
		t.Skip(msg)
	}
	return cluster.Options{}
}

// repoRoot is the repository root (the build context of the Dockerfiles).
func repoRoot(t *testing.T) string {
	t.Helper()
	root, err := filepath.Abs("../..")
	if err != nil {
		t.Fatal(err)
	}
	return root
}

// buildImages builds every image the dev overlay runs, plus the pause image, into dir.
func buildImages(ctx context.Context, t *testing.T, root, dir, tag string) []string {
	t.Helper()
	start := time.Now()
	var g errgroup.Group
	g.SetLimit(2)
	var tarballs []string
	add := func(name string, build func(out string) error) {
		out := filepath.Join(dir, name+".tar")
		tarballs = append(tarballs, out)
		g.Go(func() error { return build(out) })
	}
	for ref, dockerfile := range services {
		add(filepath.Base(ref)+"-"+tag, func(out string) error {
			return cluster.ServiceImage(ctx, root, dockerfile, ref+":"+tag, tag, out)
		})
	}
	add("pause", func(out string) error { return cluster.PauseImage(ctx, root, cluster.PauseRef, out) })
	add("postgres", func(out string) error { return cluster.PostgresImage(ctx, root, postgresImage, out) })
	add("nats", func(out string) error { return cluster.NATSImage(ctx, natsImage, out) })
	if err := g.Wait(); err != nil {
		t.Fatal(err)
	}
	t.Logf("images built in %s", time.Since(start).Round(time.Second))
	return tarballs
}

// renderDev renders the dev overlay with only the image references changed, as a platform
// team's own kustomization over it would.
func renderDev(t *testing.T, root, tag string) []byte {
	t.Helper()
	dir := t.TempDir()
	overlay, err := filepath.Rel(dir, filepath.Join(root, "k8s/overlays/dev"))
	if err != nil {
		t.Fatal(err)
	}
	var b strings.Builder
	fmt.Fprintf(&b, "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nresources:\n  - %q\nimages:\n", overlay)
	for ref := range services {
		fmt.Fprintf(&b, "  - name: %s\n    newTag: %s\n", ref, tag)
	}
	for from, to := range map[string]string{"docker.io/library/postgres": postgresImage, "docker.io/library/nats": natsImage} {
		name, newTag, _ := strings.Cut(to, ":")
		fmt.Fprintf(&b, "  - name: %s\n    newName: %s\n    newTag: %s\n", from, name, newTag)
	}
	if err := os.WriteFile(filepath.Join(dir, "kustomization.yaml"), []byte(b.String()), 0o600); err != nil {
		t.Fatal(err)
	}
	y, err := manifest.Build(dir)
	if err != nil {
		t.Fatal(err)
	}
	return y
}

// createVolumes makes the node's storage: one hostPath PersistentVolume per claim of the
// dev overlay's StatefulSets (a cluster's storage, as kind's local-path provisioner would
// give; no StorageClass, so the claims bind to them).
func createVolumes(ctx context.Context, t *testing.T, c *cluster.Cluster, n int) {
	t.Helper()
	for i := range n {
		path := filepath.Join(c.Dir, "pv", strconv.Itoa(i))
		// The pods' users differ (999, 65532) and hostPath ignores fsGroup.
		if err := os.MkdirAll(path, 0o777); err != nil {
			t.Fatal(err)
		}
		if err := os.Chmod(path, 0o777); err != nil { //nolint:gosec // a test volume for pods of several users
			t.Fatal(err)
		}
		pv := &corev1.PersistentVolume{
			ObjectMeta: metav1.ObjectMeta{Name: "node-pv-" + strconv.Itoa(i)},
			Spec: corev1.PersistentVolumeSpec{
				Capacity:                      corev1.ResourceList{corev1.ResourceStorage: resource.MustParse("10Gi")},
				AccessModes:                   []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
				PersistentVolumeReclaimPolicy: corev1.PersistentVolumeReclaimDelete,
				PersistentVolumeSource: corev1.PersistentVolumeSource{
					HostPath: &corev1.HostPathVolumeSource{Path: path},
				},
			},
		}
		if _, err := c.Client.CoreV1().PersistentVolumes().Create(ctx, pv, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
}

// waitRollout waits for every Deployment and StatefulSet of the namespace to be rolled out.
func waitRollout(ctx context.Context, t *testing.T, c *cluster.Cluster, ns string, timeout time.Duration) {
	t.Helper()
	for _, kind := range []string{"statefulset", "deployment"} {
		out, err := c.Kubectl(ctx, "-n", ns, "get", kind, "-o", "name")
		if err != nil {
			t.Fatal(err)
		}
		for _, name := range strings.Fields(string(out)) {
			if _, err := c.Kubectl(ctx, "-n", ns, "rollout", "status", name, "--timeout="+timeout.String()); err != nil {
				desc, _ := c.Kubectl(ctx, "-n", ns, "describe", "pods")
				events, _ := c.Kubectl(ctx, "-n", ns, "get", "events", "--sort-by=.lastTimestamp")
				t.Fatalf("%v\npods:\n%s\nevents:\n%s\ncluster:\n%s", err, desc, events, c.Logs())
			}
		}
	}
}

// processOf finds the host pid of a container's main process by its command name and
// returns its effective uid and whether its root is mounted read-only.
func processOf(t *testing.T, pid int) (uid int, readOnlyRoot bool) {
	t.Helper()
	status, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		t.Fatal(err)
	}
	for line := range strings.SplitSeq(string(status), "\n") {
		if rest, ok := strings.CutPrefix(line, "Uid:"); ok {
			f := strings.Fields(rest)
			if uid, err = strconv.Atoi(f[1]); err != nil {
				t.Fatal(err)
			}
		}
	}
	f, err := os.Open(fmt.Sprintf("/proc/%d/mountinfo", pid))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) > 5 && fields[4] == "/" {
			readOnlyRoot = strings.Split(fields[5], ",")[0] == "ro"
		}
	}
	return uid, readOnlyRoot
}

// pidsOf returns the host pids of the processes named comm (their /proc/PID/comm).
func pidsOf(t *testing.T, comm string) []int {
	t.Helper()
	entries, err := os.ReadDir("/proc")
	if err != nil {
		t.Fatal(err)
	}
	var pids []int
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		b, err := os.ReadFile(filepath.Join("/proc", e.Name(), "comm"))
		if err == nil && strings.TrimSpace(string(b)) == comm {
			pids = append(pids, pid)
		}
	}
	return pids
}

// leftovers lists what a torn-down cluster in dir left on the machine: its directory, a
// mount under it, a process whose root or command line is under it, the bridge, or an
// iptables chain of kube-proxy, the kubelet or the CNI plugins.
func leftovers(t *testing.T, dir string) []string {
	t.Helper()
	var left []string
	if _, err := os.Stat(dir); err == nil {
		left = append(left, "directory "+dir)
	}
	mounts, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		t.Fatal(err)
	}
	for line := range strings.Lines(string(mounts)) {
		if f := strings.Fields(line); len(f) > 4 && strings.HasPrefix(f[4], dir) {
			left = append(left, "mount "+f[4])
		}
	}
	entries, err := os.ReadDir("/proc")
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range entries {
		if _, err := strconv.Atoi(e.Name()); err != nil {
			continue
		}
		root, _ := os.Readlink(filepath.Join("/proc", e.Name(), "root"))
		cmdline, _ := os.ReadFile(filepath.Join("/proc", e.Name(), "cmdline"))
		if strings.HasPrefix(root, dir) || strings.Contains(string(cmdline), dir) {
			left = append(left, fmt.Sprintf("process %s (%s)", e.Name(), strings.ReplaceAll(string(cmdline), "\x00", " ")))
		}
	}
	if out, err := exec.Command("ip", "link", "show", cluster.Bridge).CombinedOutput(); err == nil {
		left = append(left, "link "+strings.TrimSpace(string(out)))
	}
	for _, bin := range []string{"iptables-save", "ip6tables-save"} {
		out, err := exec.Command(bin).Output()
		if err != nil {
			continue
		}
		for line := range strings.Lines(string(out)) {
			if strings.HasPrefix(line, ":KUBE-") || strings.HasPrefix(line, ":CNI-") {
				left = append(left, bin+" chain "+strings.Fields(line)[0][1:])
			}
		}
	}
	return left
}

func TestManifestsAsPods(t *testing.T) {
	opts := requireCluster(t)
	ctx, cancel := context.WithTimeout(context.Background(), 25*time.Minute)
	defer cancel()
	root := repoRoot(t)
	opts.Images = buildImages(ctx, t, root, t.TempDir(), testTag)

	start := time.Now()
	c, err := cluster.Start(ctx, opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("cluster logs:\n%s", c.Logs())
		}
		if err := c.Stop(); err != nil {
			t.Errorf("tear down: %v", err)
		}
		for _, l := range leftovers(t, c.Dir) {
			t.Errorf("left behind: %s", l)
		}
	})
	t.Logf("cluster up in %s", time.Since(start).Round(time.Second))

	createVolumes(ctx, t, c, 2)
	manifests := filepath.Join(t.TempDir(), "dev.yaml")
	if err := os.WriteFile(manifests, renderDev(t, root, testTag), 0o600); err != nil {
		t.Fatal(err)
	}
	cli := buildCLI(ctx, t, root)
	start = time.Now()
	if out, err := c.Kubectl(ctx, "apply", "--server-side", "-f", manifests); err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	tlsDir := meshTLS(ctx, t, c, cli)
	waitRollout(ctx, t, c, "curfew", 8*time.Minute)
	t.Logf("dev overlay Ready in %s", time.Since(start).Round(time.Second))

	t.Run("pods run as 65532 on a read-only root", func(t *testing.T) {
		for _, comm := range []string{"orchestrator", "toolrunner", "subagent", "modelproxy"} {
			pids := pidsOf(t, comm)
			if len(pids) != 2 {
				t.Errorf("%s: %d processes, want the Deployment's 2 replicas", comm, len(pids))
			}
			for _, pid := range pids {
				uid, ro := processOf(t, pid)
				if uid != 65532 || !ro {
					t.Errorf("%s pid %d: uid %d, read-only root %v; want 65532 and true", comm, pid, uid, ro)
				}
			}
		}
	})

	api := dialAPI(t, tlsDir, portForward(ctx, t, c, "curfew", "svc/curfew-api", "7700"))
	testRunThroughTheService(ctx, t, api)
	t.Run("a rolling update of all four Deployments under load loses no run", func(t *testing.T) {
		testRollingUpdate(ctx, t, c, tlsDir)
	})
	t.Run("a pod of each service deleted with --force mid-run", func(t *testing.T) {
		testForcedDeletion(ctx, t, c, tlsDir)
	})
}
