package cluster

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"
)

// containerdConfig is containerd's configuration (version 2, as Debian's containerd 1.6
// reads it): state, sockets and the CNI configuration under the cluster's directory, the
// cgroupfs driver (the kubelet's), and the pause image the test imports.
const containerdConfig = `version = 2
root = "%[1]s/root"
state = "%[1]s/state"
disabled_plugins = ["io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.devmapper"]

[grpc]
  address = "%[1]s/containerd.sock"

[ttrpc]
  address = "%[1]s/containerd.sock.ttrpc"

[plugins."io.containerd.internal.v1.opt"]
  path = "%[1]s/opt"

[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "%[2]s"
  enable_selinux = false
  disable_apparmor = true
  # The sandboxes' network namespaces under the state directory, so that Stop finds any
  # that outlived their sandbox.
  netns_mounts_under_state_dir = true
  # The kubelet asks for negative oom_score_adj values (-998 for sandboxes), which a
  # machine that runs the test in a sandbox of its own may refuse (it does on ours):
  # clamp them to containerd's own.
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "%[3]s"
    conf_dir = "%[4]s"
`

// cniConfig is the pods' network: a bridge with host-local addresses, masquerading out,
// hairpin for a pod reaching itself through a Service, and portmap for hostPorts.
const cniConfig = `{
  "cniVersion": "0.4.0",
  "name": "curfew-test",
  "plugins": [
    {
      "type": "bridge",
      "bridge": %[1]q,
      "isGateway": true,
      "ipMasq": true,
      "hairpinMode": true,
      "ipam": {
        "type": "host-local",
        "ranges": [[{"subnet": %[2]q, "gateway": %[3]q}]],
        "routes": [{"dst": "0.0.0.0/0"}],
        "dataDir": %[4]q
      }
    },
    {"type": "portmap", "capabilities": {"portMappings": true}}
  ]
}
`

func (c *Cluster) containerdDir() string { return filepath.Join(c.Dir, "containerd") }
func (c *Cluster) containerdSocket() string {
	return filepath.Join(c.containerdDir(), "containerd.sock")
}

func (c *Cluster) startContainerd(ctx context.Context) error {
	cni := filepath.Join(c.Dir, "cni", "net.d", "10-curfew.conflist")
	body := fmt.Sprintf(cniConfig, Bridge, PodCIDR, NodeIP, filepath.Join(c.Dir, "cni", "ipam"))
	if err := os.WriteFile(cni, []byte(body), 0o644); err != nil {
		return fmt.Errorf("cluster: %w", err)
	}
	config := filepath.Join(c.containerdDir(), "config.toml")
	body = fmt.Sprintf(containerdConfig, c.containerdDir(), PauseRef, c.opts.CNIBin, filepath.Dir(cni))
	if err := os.WriteFile(config, []byte(body), 0o600); err != nil {
		return fmt.Errorf("cluster: %w", err)
	}
	return c.run(ctx, func(ctx context.Context) error {
		_, err := c.cri(ctx, func(ctx context.Context, rt runtimeapi.RuntimeServiceClient) (any, error) {
			return rt.Version(ctx, &runtimeapi.VersionRequest{})
		})
		return err
	}, c.opts.Containerd, "--config", config)
}

func (c *Cluster) importImages(ctx context.Context) error {
	if len(c.opts.Images) == 0 {
		return nil
	}
	return Import(ctx, c.opts.Ctr, c.containerdSocket(), c.opts.Images...)
}

// ImportImages loads more image tarballs into the node's containerd (a new tag for a
// rolling update, say).
func (c *Cluster) ImportImages(ctx context.Context, tarballs ...string) error {
	return Import(ctx, c.opts.Ctr, c.containerdSocket(), tarballs...)
}

func (c *Cluster) containerdRunning() bool {
	for _, p := range c.procs {
		if p.Name() == "containerd" {
			exited, _ := p.Exited()
			return !exited
		}
	}
	return false
}

// cri calls containerd's CRI runtime service.
func (c *Cluster) cri(ctx context.Context, call func(context.Context, runtimeapi.RuntimeServiceClient) (any, error)) (any, error) {
	conn, err := grpc.NewClient("unix://"+c.containerdSocket(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return nil, err
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	return call(ctx, runtimeapi.NewRuntimeServiceClient(conn))
}

// removeSandboxes stops and removes every pod sandbox, as `crictl rmp -fa` does: stopping
// a sandbox runs the CNI plugins' DEL (addresses, veth, masquerade rules) and removes its
// network namespace.
func (c *Cluster) removeSandboxes(ctx context.Context) error {
	res, err := c.cri(ctx, func(ctx context.Context, rt runtimeapi.RuntimeServiceClient) (any, error) {
		return rt.ListPodSandbox(ctx, &runtimeapi.ListPodSandboxRequest{})
	})
	if err != nil {
		return fmt.Errorf("cluster: list sandboxes: %w", err)
	}
	var errs []error
	for _, sb := range res.(*runtimeapi.ListPodSandboxResponse).GetItems() {
		_, err := c.cri(ctx, func(ctx context.Context, rt runtimeapi.RuntimeServiceClient) (any, error) {
			if _, err := rt.StopPodSandbox(ctx, &runtimeapi.StopPodSandboxRequest{PodSandboxId: sb.GetId()}); err != nil {
				return nil, err
			}
			return rt.RemovePodSandbox(ctx, &runtimeapi.RemovePodSandboxRequest{PodSandboxId: sb.GetId()})
		})
		if err != nil {
			errs = append(errs, fmt.Errorf("cluster: remove sandbox %s/%s: %w", sb.GetMetadata().GetNamespace(), sb.GetMetadata().GetName(), err))
		}
	}
	return errors.Join(errs...)
}

// TagImage gives an image in the node's containerd another reference, as a push of the
// same build under a new tag would (a rolling update to a new tag, say).
func (c *Cluster) TagImage(ctx context.Context, from, to string) error {
	out, err := exec.CommandContext(ctx, c.opts.Ctr, "--address", c.containerdSocket(), "--namespace", "k8s.io", "images", "tag", "--force", from, to).CombinedOutput()
	if err != nil {
		return fmt.Errorf("cluster: ctr images tag %s %s: %w: %s", from, to, err, out)
	}
	return nil
}
