package cluster

import (
	"bufio"
	"context"
	"crypto/tls"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// hostSysctls are the kernel settings the node needs: forwarding between the bridge and
// Services' DNAT, and bridged traffic through iptables so that a pod reaching another pod on
// the same bridge through a ClusterIP gets its reply un-NATed.
var hostSysctls = map[string]string{
	"/proc/sys/net/ipv4/ip_forward":                 "1",
	"/proc/sys/net/bridge/bridge-nf-call-iptables":  "1",
	"/proc/sys/net/bridge/bridge-nf-call-ip6tables": "1",
}

// hostState is what prepareHost changed on the machine, kept in the cluster's directory
// (hostFile) so that Reap can undo it for a test binary that died without Stop.
type hostState struct {
	Dir     string            `json:"dir"`
	Sysctls map[string]string `json:"sysctls"` // path to the value before
	Bridge  bool              `json:"bridge"`
	// KubeProxy is the kube-proxy binary whose --cleanup removes its rules.
	KubeProxy string `json:"kubeProxy,omitempty"`
}

// Files in a cluster's directory.
const (
	dirPrefix = "curfew-cluster-"
	ownerFile = "owner.pid" // the pid of the process that started the cluster
	hostFile  = "host.json" // its hostState
)

// prepareHost sets hostSysctls and creates Bridge with NodeIP, so that the kubelet and
// CoreDNS can use the address before the first pod makes the CNI plugin create it. The
// state it returns restores the machine even when it fails halfway.
func prepareHost(ctx context.Context, dir, kubeProxy string) (*hostState, error) {
	h := &hostState{Dir: dir, Sysctls: map[string]string{}, KubeProxy: kubeProxy}
	for path, want := range hostSysctls {
		before, err := os.ReadFile(path)
		if err != nil {
			return h, fmt.Errorf("cluster: sysctl %s: %w", path, err)
		}
		h.Sysctls[path] = strings.TrimSpace(string(before))
		if err := h.save(); err != nil {
			return h, err
		}
		if err := os.WriteFile(path, []byte(want), 0o644); err != nil {
			return h, fmt.Errorf("cluster: sysctl %s: %w", path, err)
		}
	}
	if out, err := exec.CommandContext(ctx, "ip", "link", "show", Bridge).CombinedOutput(); err == nil {
		return h, fmt.Errorf("cluster: a %s link already exists (another cluster is running): %s", Bridge, out)
	}
	h.Bridge = true
	if err := h.save(); err != nil {
		return h, err
	}
	for _, args := range [][]string{
		{"link", "add", Bridge, "type", "bridge"},
		{"addr", "add", NodeIP + "/24", "dev", Bridge},
		{"link", "set", Bridge, "up"},
	} {
		if out, err := exec.CommandContext(ctx, "ip", args...).CombinedOutput(); err != nil {
			return h, fmt.Errorf("cluster: ip %s: %w: %s", strings.Join(args, " "), err, out)
		}
	}
	return h, nil
}

func (h *hostState) save() error {
	b, err := json.Marshal(h)
	if err != nil {
		return fmt.Errorf("cluster: %w", err)
	}
	if err := os.WriteFile(filepath.Join(h.Dir, hostFile), b, 0o600); err != nil {
		return fmt.Errorf("cluster: %w", err)
	}
	return nil
}

// restore undoes what the cluster left on the machine once its components have stopped:
// kube-proxy's rules, containers and shims that outlived containerd, mounts under the
// directory, the bridge, and the sysctls. A nil hostState (a cluster that failed before
// prepareHost) has nothing to undo.
func (h *hostState) restore(ctx context.Context) error {
	if h == nil {
		return nil
	}
	var errs []error
	if h.KubeProxy != "" {
		// kube-proxy's chains; it reports an error for the modes it did not use.
		_ = exec.CommandContext(ctx, h.KubeProxy, "--cleanup").Run()
	}
	errs = append(errs, killLeftovers(h.Dir), unmountUnder(h.Dir), removeKubeletChains(ctx))
	if h.Bridge {
		if out, err := exec.CommandContext(ctx, "ip", "link", "del", Bridge).CombinedOutput(); err != nil && !strings.Contains(string(out), "Cannot find device") {
			errs = append(errs, fmt.Errorf("cluster: ip link del %s: %w: %s", Bridge, err, out))
		}
	}
	for path, before := range h.Sysctls {
		if err := os.WriteFile(path, []byte(before), 0o644); err != nil {
			errs = append(errs, fmt.Errorf("cluster: sysctl %s: %w", path, err))
		}
	}
	return errors.Join(errs...)
}

// kubeletChains are the iptables chains the kubelet makes for itself (kube-proxy --cleanup
// leaves them).
var kubeletChains = []string{"KUBE-FIREWALL", "KUBE-KUBELET-CANARY", "KUBE-IPTABLES-HINT"}

// removeKubeletChains deletes kubeletChains and the rules that jump to them, in every
// table, for IPv4 and IPv6.
func removeKubeletChains(ctx context.Context) error {
	var errs []error
	for _, bin := range []string{"iptables", "ip6tables"} {
		for _, table := range []string{"filter", "nat", "mangle"} {
			out, err := exec.CommandContext(ctx, bin+"-save", "-t", table).Output()
			if err != nil {
				continue // no such table, or no such family
			}
			present := map[string]bool{}
			for line := range strings.Lines(string(out)) {
				f := strings.Fields(line)
				if len(f) > 0 && strings.HasPrefix(f[0], ":") && slices.Contains(kubeletChains, f[0][1:]) {
					present[f[0][1:]] = true
				}
				// "-A INPUT -j KUBE-FIREWALL": a jump into a kubelet chain from another.
				if len(f) >= 4 && f[0] == "-A" && !slices.Contains(kubeletChains, f[1]) && f[len(f)-2] == "-j" && slices.Contains(kubeletChains, f[len(f)-1]) {
					if out, err := exec.CommandContext(ctx, bin, append([]string{"-t", table, "-D"}, f[1:]...)...).CombinedOutput(); err != nil {
						errs = append(errs, fmt.Errorf("cluster: %s -t %s -D %s: %w: %s", bin, table, strings.Join(f[1:], " "), err, out))
					}
				}
			}
			for chain := range present {
				for _, op := range []string{"-F", "-X"} {
					if out, err := exec.CommandContext(ctx, bin, "-t", table, op, chain).CombinedOutput(); err != nil {
						errs = append(errs, fmt.Errorf("cluster: %s -t %s %s %s: %w: %s", bin, table, op, chain, err, out))
					}
				}
			}
		}
	}
	return errors.Join(errs...)
}

// Reap tears down what clusters whose test binary died without Stop left behind (a
// -timeout panic or a signal runs no cleanup): for each cluster directory whose owner is
// gone, it undoes its hostState and removes the directory. Start calls it.
func Reap(ctx context.Context) error {
	dirs, err := filepath.Glob(filepath.Join(os.TempDir(), dirPrefix+"*"))
	if err != nil {
		return fmt.Errorf("cluster: %w", err)
	}
	ctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	var errs []error
	for _, dir := range dirs {
		if pid, err := os.ReadFile(filepath.Join(dir, ownerFile)); err == nil {
			if n, err := strconv.Atoi(string(pid)); err == nil && unix.Kill(n, 0) == nil && n != os.Getpid() {
				continue // its test is still running
			}
		}
		h := &hostState{Dir: dir}
		if b, err := os.ReadFile(filepath.Join(dir, hostFile)); err == nil {
			if err := json.Unmarshal(b, h); err != nil {
				errs = append(errs, fmt.Errorf("cluster: %s: %w", dir, err))
				continue
			}
		}
		h.Dir = dir
		if err := h.restore(ctx); err != nil {
			errs = append(errs, err)
			continue
		}
		errs = append(errs, os.RemoveAll(dir))
	}
	return errors.Join(errs...)
}

// killLeftovers kills, with SIGKILL, the processes that belong to the cluster in dir but
// outlived it: containers (their root is a rootfs under dir) and runc shims (their command
// line names the containerd socket under dir; they run apart from containerd by design).
func killLeftovers(dir string) error {
	entries, err := os.ReadDir("/proc")
	if err != nil {
		return fmt.Errorf("cluster: %w", err)
	}
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil || pid == os.Getpid() {
			continue
		}
		root, _ := os.Readlink(filepath.Join("/proc", e.Name(), "root"))
		cmdline, _ := os.ReadFile(filepath.Join("/proc", e.Name(), "cmdline"))
		args := strings.Split(string(cmdline), "\x00")
		shim := strings.HasPrefix(filepath.Base(args[0]), "containerd-shim") && strings.Contains(string(cmdline), dir)
		if shim || strings.HasPrefix(root, dir+"/") {
			_ = unix.Kill(pid, unix.SIGKILL)
		}
	}
	return nil
}

// unmountUnder detaches every mount at or below dir, deepest first: the kubelet's volumes
// (tmpfs for Secrets and projected tokens), containerd's overlay snapshots and sandbox
// /dev/shm, and the network namespaces' bind mounts if they live there.
func unmountUnder(dir string) error {
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return fmt.Errorf("cluster: %w", err)
	}
	defer f.Close()
	var points []string
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) < 5 {
			continue
		}
		// Field 5 is the mount point, octal-escaped.
		mp := unescapeMount(fields[4])
		if mp == dir || strings.HasPrefix(mp, dir+"/") {
			points = append(points, mp)
		}
	}
	if err := sc.Err(); err != nil {
		return fmt.Errorf("cluster: %w", err)
	}
	sort.Slice(points, func(i, j int) bool { return len(points[i]) > len(points[j]) })
	var errs []error
	for _, mp := range points {
		if err := unix.Unmount(mp, unix.MNT_DETACH); err != nil && !errors.Is(err, unix.EINVAL) && !errors.Is(err, unix.ENOENT) {
			errs = append(errs, fmt.Errorf("cluster: unmount %s: %w", mp, err))
		}
	}
	return errors.Join(errs...)
}

// unescapeMount undoes mountinfo's octal escapes (\040 for a space, and so on).
func unescapeMount(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+3 < len(s) {
			var v int
			if _, err := fmt.Sscanf(s[i+1:i+4], "%03o", &v); err == nil {
				b.WriteByte(byte(v))
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

// insecureTLS is for the components' loopback healthz endpoints, which serve certificates
// they generated for themselves at start.
func insecureTLS() *tls.Config {
	return &tls.Config{InsecureSkipVerify: true} //nolint:gosec // loopback readiness probe, see above
}
