package cluster

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"

	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"

	"github.com/curfew-mesh/curfew/k8s/apiserver"
	"github.com/curfew-mesh/curfew/k8s/internal/proc"
)

// The environment variables that name the binaries when Options leaves them empty.
const (
	// EnvNode names the directory of kubelet, kube-controller-manager, kube-scheduler,
	// kube-proxy and kubectl (scripts/kube-node.sh prints it).
	EnvNode = "CURFEW_KUBE_NODE"
	// EnvCoreDNS names the CoreDNS binary (scripts/coredns.sh prints it).
	EnvCoreDNS = "CURFEW_COREDNS"
)

// The node's network: one CNI bridge whose address is also the node's address and the
// cluster DNS server's, and the Service range the API server allocates from.
const (
	// NodeName is the name the kubelet registers.
	NodeName = "curfew-node"
	// Bridge is the Linux bridge the pods' veths are attached to.
	Bridge = "curfew0"
	// PodCIDR is the pods' address range (host-local IPAM on Bridge).
	PodCIDR = "10.244.0.0/24"
	// NodeIP is Bridge's address: the node's InternalIP, the pods' gateway, and where
	// CoreDNS answers (the kubelet's clusterDNS).
	NodeIP = "10.244.0.1"
	// ServiceCIDR is the ClusterIP range.
	ServiceCIDR = "10.96.0.0/16"
	// PauseRef is the sandbox image; the test builds it (PauseImage) and imports it.
	PauseRef = "registry.k8s.io/pause:3.10"
)

// Options configures Start. The zero value takes the binaries from the environment and
// Debian's paths.
type Options struct {
	// NodeBin is the directory of kubelet and the rest; empty means $CURFEW_KUBE_NODE.
	NodeBin string
	// CoreDNS is the CoreDNS binary; empty means $CURFEW_COREDNS.
	CoreDNS string
	// APIServer and Etcd as in apiserver.Options (empty: from the environment).
	APIServer, Etcd string
	// Containerd, Ctr and CNIBin default to Debian's /usr/bin/containerd, /usr/bin/ctr and
	// /usr/lib/cni (packages containerd, runc and containernetworking-plugins).
	Containerd, Ctr, CNIBin string
	// Images are image tarballs imported into containerd's k8s.io namespace before the
	// kubelet starts; one of them must hold PauseRef.
	Images []string
	// ReadyTimeout bounds the wait for each component; zero means 2 minutes.
	ReadyTimeout time.Duration
}

// Cluster is a running one-node cluster. Stop it when done, also when a test fails.
type Cluster struct {
	// Dir holds every component's configuration, state and log.
	Dir string
	// Config reaches the API server as an administrator.
	Config *rest.Config
	// Client is a clientset on Config.
	Client kubernetes.Interface
	// Kubeconfig is a kubeconfig file with Config, for kubectl.
	Kubeconfig string

	opts     Options
	api      *apiserver.Server
	procs    []*proc.Process // started in this order, stopped in reverse
	host     *hostState
	stopOnce sync.Once
	stopErr  error
}

// Start brings up a one-node cluster: etcd and kube-apiserver (package apiserver),
// containerd with the CNI bridge, kube-controller-manager, kube-scheduler, the kubelet,
// kube-proxy in iptables mode, and CoreDNS. It returns once the node is Ready. On error
// everything it started is torn down.
//
// It needs root: it creates Bridge, sets net.ipv4.ip_forward and
// net.bridge.bridge-nf-call-iptables (restored by Stop), and runs containers.
func Start(ctx context.Context, opts Options) (*Cluster, error) {
	if err := opts.defaults(); err != nil {
		return nil, err
	}
	// A test binary killed at its -timeout (or by a signal) runs no cleanup: take down
	// what such a cluster left before making a new one.
	if err := Reap(ctx); err != nil {
		return nil, err
	}
	dir, err := os.MkdirTemp("", dirPrefix)
	if err != nil {
		return nil, fmt.Errorf("cluster: %w", err)
	}
	if err := os.WriteFile(filepath.Join(dir, ownerFile), []byte(strconv.Itoa(os.Getpid())), 0o600); err != nil {
		return nil, errors.Join(fmt.Errorf("cluster: %w", err), os.RemoveAll(dir))
	}
	c := &Cluster{Dir: dir, opts: opts}
	if err := c.start(ctx); err != nil {
		return nil, errors.Join(err, c.stop(context.WithoutCancel(ctx)))
	}
	return c, nil
}

func (o *Options) defaults() error {
	env := func(v *string, name string) {
		if *v == "" {
			*v = os.Getenv(name)
		}
	}
	env(&o.NodeBin, EnvNode)
	env(&o.CoreDNS, EnvCoreDNS)
	env(&o.APIServer, apiserver.EnvAPIServer)
	env(&o.Etcd, apiserver.EnvEtcd)
	def := func(v *string, d string) {
		if *v == "" {
			*v = d
		}
	}
	def(&o.Containerd, "/usr/bin/containerd")
	def(&o.Ctr, "/usr/bin/ctr")
	def(&o.CNIBin, "/usr/lib/cni")
	if o.ReadyTimeout <= 0 {
		o.ReadyTimeout = 2 * time.Minute
	}
	var missing []string
	for what, path := range map[string]string{
		EnvNode + " (scripts/kube-node.sh)":                          filepath.Join(o.NodeBin, "kubelet"),
		EnvCoreDNS + " (scripts/coredns.sh)":                         o.CoreDNS,
		apiserver.EnvAPIServer + " (scripts/kube-apiserver.sh)":      o.APIServer,
		apiserver.EnvEtcd + " (scripts/etcd.sh)":                     o.Etcd,
		"containerd (Debian containerd)":                             o.Containerd,
		"ctr (Debian containerd)":                                    o.Ctr,
		"runc (Debian runc)":                                         "/usr/bin/runc",
		"the CNI bridge plugin (Debian containernetworking-plugins)": filepath.Join(o.CNIBin, "bridge"),
		"iptables (Debian iptables)":                                 "/usr/sbin/iptables",
	} {
		if path == "" || path == "kubelet" {
			missing = append(missing, what)
			continue
		}
		if _, err := os.Stat(path); err != nil {
			missing = append(missing, what+": "+err.Error())
		}
	}
	if len(missing) > 0 {
		return fmt.Errorf("cluster: missing %s", strings.Join(missing, "; "))
	}
	if os.Geteuid() != 0 {
		return errors.New("cluster: needs root (containers, a bridge, iptables)")
	}
	return nil
}

func (c *Cluster) start(ctx context.Context) error {
	for _, d := range []string{"logs", "kubelet", "pods-logs", "cni/net.d", "cni/ipam", "containerd", "pv"} {
		if err := os.MkdirAll(filepath.Join(c.Dir, d), 0o755); err != nil {
			return fmt.Errorf("cluster: %w", err)
		}
	}
	host, err := prepareHost(ctx, c.Dir, c.node("kube-proxy"))
	c.host = host
	if err != nil {
		return err
	}
	api, err := apiserver.Start(ctx, apiserver.Options{
		APIServer:    c.opts.APIServer,
		Etcd:         c.opts.Etcd,
		ReadyTimeout: c.opts.ReadyTimeout,
		Dir:          filepath.Join(c.Dir, "apiserver"),
		ExtraArgs: []string{
			"--service-cluster-ip-range=" + ServiceCIDR,
			// The node's address, so that port-forward and logs reach the kubelet.
			"--kubelet-preferred-address-types=InternalIP",
		},
	})
	if err != nil {
		return err
	}
	c.api = api
	c.Config = api.Config
	if c.Client, err = kubernetes.NewForConfig(c.Config); err != nil {
		return fmt.Errorf("cluster: %w", err)
	}
	if c.Kubeconfig, err = c.writeKubeconfig(); err != nil {
		return err
	}
	steps := []func(context.Context) error{
		c.startContainerd,
		c.importImages,
		c.startControllerManager,
		c.startScheduler,
		c.startKubelet,
		c.startKubeProxy,
		c.startCoreDNS,
		c.waitNodeReady,
	}
	for _, step := range steps {
		if err := step(ctx); err != nil {
			return err
		}
	}
	return nil
}

// Kubectl runs kubectl against the cluster and returns its combined output.
func (c *Cluster) Kubectl(ctx context.Context, args ...string) ([]byte, error) {
	cmd := exec.CommandContext(ctx, filepath.Join(c.opts.NodeBin, "kubectl"), append([]string{"--kubeconfig=" + c.Kubeconfig}, args...)...)
	out, err := cmd.CombinedOutput()
	if err != nil {
		return out, fmt.Errorf("kubectl %s: %w: %s", strings.Join(args, " "), err, out)
	}
	return out, nil
}

// Logs returns the tail of every component's log, for failure messages.
func (c *Cluster) Logs() string {
	var b strings.Builder
	if c.api != nil {
		b.WriteString(c.api.Logs())
		b.WriteString("\n")
	}
	for _, p := range c.procs {
		fmt.Fprintf(&b, "%s:\n%s\n", p.Name(), p.Tail())
	}
	return b.String()
}

// writeKubeconfig writes the administrator's kubeconfig for the components and kubectl.
func (c *Cluster) writeKubeconfig() (string, error) {
	cfg := clientcmdapi.NewConfig()
	cfg.Clusters["curfew"] = &clientcmdapi.Cluster{Server: c.Config.Host, CertificateAuthorityData: c.Config.CAData}
	cfg.AuthInfos["admin"] = &clientcmdapi.AuthInfo{Token: c.Config.BearerToken}
	cfg.Contexts["curfew"] = &clientcmdapi.Context{Cluster: "curfew", AuthInfo: "admin", Namespace: "default"}
	cfg.CurrentContext = "curfew"
	path := filepath.Join(c.Dir, "kubeconfig")
	if err := clientcmd.WriteToFile(*cfg, path); err != nil {
		return "", fmt.Errorf("cluster: kubeconfig: %w", err)
	}
	return path, nil
}

// run starts one component and waits for ready; it joins c.procs either way, so that Stop
// ends it.
func (c *Cluster) run(ctx context.Context, ready func(context.Context) error, bin string, args ...string) error {
	p, err := proc.Start(ctx, bin, filepath.Join(c.Dir, "logs", filepath.Base(bin)+".log"), args...)
	if err != nil {
		return fmt.Errorf("cluster: %w", err)
	}
	c.procs = append(c.procs, p)
	if err := p.WaitReady(ctx, c.opts.ReadyTimeout, ready); err != nil {
		return fmt.Errorf("cluster: %w", err)
	}
	return nil
}

// healthz is a readiness check on a component's plain-HTTP or self-signed healthz URL.
func healthz(url string) func(context.Context) error {
	client := &http.Client{
		Timeout:   5 * time.Second,
		Transport: &http.Transport{TLSClientConfig: insecureTLS()},
	}
	return func(ctx context.Context) error { return proc.GetOK(ctx, client, url, "") }
}

func freePort(ctx context.Context) (string, error) {
	ports, err := proc.FreePorts(ctx, 1)
	if err != nil {
		return "", err
	}
	return strconv.Itoa(ports[0]), nil
}

func (c *Cluster) node(bin string) string { return filepath.Join(c.opts.NodeBin, bin) }

func (c *Cluster) startControllerManager(ctx context.Context) error {
	port, err := freePort(ctx)
	if err != nil {
		return err
	}
	apiDir := filepath.Join(c.Dir, "apiserver")
	return c.run(ctx, healthz("https://127.0.0.1:"+port+"/healthz"), c.node("kube-controller-manager"),
		"--kubeconfig="+c.Kubeconfig,
		"--authentication-kubeconfig="+c.Kubeconfig,
		"--authorization-kubeconfig="+c.Kubeconfig,
		"--bind-address=127.0.0.1",
		"--secure-port="+port,
		"--cert-dir="+filepath.Join(c.Dir, "controller-manager"),
		"--leader-elect=false",
		"--service-account-private-key-file="+filepath.Join(apiDir, "sa.key"),
		"--root-ca-file="+filepath.Join(apiDir, "certs", "apiserver.crt"),
		"--service-cluster-ip-range="+ServiceCIDR,
		"--cluster-cidr="+PodCIDR,
		"--allocate-node-cidrs=false",
		"--use-service-account-credentials=false",
	)
}

func (c *Cluster) startScheduler(ctx context.Context) error {
	port, err := freePort(ctx)
	if err != nil {
		return err
	}
	return c.run(ctx, healthz("https://127.0.0.1:"+port+"/healthz"), c.node("kube-scheduler"),
		"--kubeconfig="+c.Kubeconfig,
		"--authentication-kubeconfig="+c.Kubeconfig,
		"--authorization-kubeconfig="+c.Kubeconfig,
		"--bind-address=127.0.0.1",
		"--secure-port="+port,
		"--cert-dir="+filepath.Join(c.Dir, "scheduler"),
		"--leader-elect=false",
	)
}

// kubeletConfig is the kubelet's configuration file. Anonymous access with AlwaysAllow is
// for the API server's port-forward and logs calls alone: the kubelet listens on the
// bridge address, which only this machine reaches.
const kubeletConfig = `apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: %[1]s
port: 10250
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: %[2]s
authentication:
  anonymous: {enabled: true}
  webhook: {enabled: false}
authorization:
  mode: AlwaysAllow
containerRuntimeEndpoint: unix://%[3]s
clusterDNS: [%[1]s]
clusterDomain: cluster.local
resolvConf: /etc/resolv.conf
podLogsDir: %[4]s
cgroupDriver: cgroupfs
cgroupsPerQOS: false
enforceNodeAllocatable: []
failCgroupV1: false
failSwapOn: false
evictionHard:
  memory.available: 100Mi
  nodefs.available: 1%%
  nodefs.inodesFree: 1%%
  imagefs.available: 1%%
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
serializeImagePulls: false
registerNode: true
`

func (c *Cluster) startKubelet(ctx context.Context) error {
	port, err := freePort(ctx)
	if err != nil {
		return err
	}
	config := filepath.Join(c.Dir, "kubelet.yaml")
	body := fmt.Sprintf(kubeletConfig, NodeIP, port, c.containerdSocket(), filepath.Join(c.Dir, "pods-logs"))
	if err := os.WriteFile(config, []byte(body), 0o600); err != nil {
		return fmt.Errorf("cluster: %w", err)
	}
	return c.run(ctx, healthz("http://127.0.0.1:"+port+"/healthz"), c.node("kubelet"),
		"--config="+config,
		"--kubeconfig="+c.Kubeconfig,
		"--root-dir="+filepath.Join(c.Dir, "kubelet"),
		"--hostname-override="+NodeName,
		"--node-ip="+NodeIP,
		"--v=1",
	)
}

// kubeProxyConfig is kube-proxy's configuration: iptables mode, and no conntrack sysctls
// (the machine's own are left alone).
const kubeProxyConfig = `apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
clientConnection:
  kubeconfig: %[1]s
mode: iptables
clusterCIDR: %[2]s
hostnameOverride: %[3]s
bindAddress: 127.0.0.1
healthzBindAddress: 127.0.0.1:%[4]s
metricsBindAddress: 127.0.0.1:%[5]s
conntrack:
  maxPerCore: 0
  min: 0
  tcpEstablishedTimeout: 0s
  tcpCloseWaitTimeout: 0s
iptables:
  localhostNodePorts: false
`

func (c *Cluster) startKubeProxy(ctx context.Context) error {
	ports, err := proc.FreePorts(ctx, 2)
	if err != nil {
		return err
	}
	config := filepath.Join(c.Dir, "kube-proxy.yaml")
	body := fmt.Sprintf(kubeProxyConfig, c.Kubeconfig, PodCIDR, NodeName, strconv.Itoa(ports[0]), strconv.Itoa(ports[1]))
	if err := os.WriteFile(config, []byte(body), 0o600); err != nil {
		return fmt.Errorf("cluster: %w", err)
	}
	// Ready once it has synced its rules (healthz answers 200 only then).
	return c.run(ctx, healthz("http://127.0.0.1:"+strconv.Itoa(ports[0])+"/healthz"), c.node("kube-proxy"), "--config="+config)
}

// corefile is kubeadm's default Corefile (answers with a 5 s TTL, cached at most 30 s)
// without the upstream forwarder (this machine has
// no resolver beyond its own names): cluster.local from the API server, on the node's
// address.
const corefile = `.:53 {
    bind %[1]s
    errors
    health 127.0.0.1:%[2]s
    kubernetes cluster.local in-addr.arpa ip6.arpa {
        kubeconfig %[3]s
        pods insecure
        fallthrough in-addr.arpa ip6.arpa
    }
    cache 30
    loop
    reload
    loadbalance
}
`

func (c *Cluster) startCoreDNS(ctx context.Context) error {
	port, err := freePort(ctx)
	if err != nil {
		return err
	}
	path := filepath.Join(c.Dir, "Corefile")
	if err := os.WriteFile(path, []byte(fmt.Sprintf(corefile, NodeIP, port, c.Kubeconfig)), 0o600); err != nil {
		return fmt.Errorf("cluster: %w", err)
	}
	ready := healthz("http://127.0.0.1:" + port + "/health")
	return c.run(ctx, func(ctx context.Context) error {
		if err := ready(ctx); err != nil {
			return err
		}
		// And it answers for the cluster: the kubernetes Service always exists.
		r := &net.Resolver{PreferGo: true, Dial: func(ctx context.Context, _, _ string) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, "udp", net.JoinHostPort(NodeIP, "53"))
		}}
		_, err := r.LookupHost(ctx, "kubernetes.default.svc.cluster.local")
		return err
	}, c.opts.CoreDNS, "-conf", path)
}

// waitNodeReady waits for the node to register and report Ready.
func (c *Cluster) waitNodeReady(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, c.opts.ReadyTimeout)
	defer cancel()
	var last string
	for {
		out, err := c.Kubectl(ctx, "get", "node", NodeName, "-o", `jsonpath={.status.conditions[?(@.type=="Ready")].status}`)
		if err == nil && strings.TrimSpace(string(out)) == "True" {
			return nil
		}
		last = strings.TrimSpace(string(out))
		select {
		case <-ctx.Done():
			return fmt.Errorf("cluster: node %s not Ready after %s (last: %q); logs:\n%s", NodeName, c.opts.ReadyTimeout, last, c.Logs())
		case <-time.After(time.Second):
		}
	}
}

// Stop tears the cluster down, also after a failed start: every pod sandbox is stopped and
// removed through the CRI (so the CNI plugins release addresses, veths and rules), then the
// components in reverse order, kube-proxy's rules, leftover shims and mounts, the bridge and
// the sysctls, and the directory. It may be called more than once.
func (c *Cluster) Stop() error {
	return c.stop(context.Background())
}

// stop is Stop; ctx carries values only: the teardown has its own time bound.
func (c *Cluster) stop(ctx context.Context) error {
	c.stopOnce.Do(func() {
		var errs []error
		ctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
		defer cancel()
		// The kubelet first, so that it does not restart what is being removed.
		for i := len(c.procs) - 1; i >= 0; i-- {
			if c.procs[i].Name() == "kubelet" {
				c.procs[i].Stop()
			}
		}
		if c.containerdRunning() {
			errs = append(errs, c.removeSandboxes(ctx))
		}
		for i := len(c.procs) - 1; i >= 0; i-- {
			c.procs[i].Stop()
		}
		if c.api != nil {
			errs = append(errs, c.api.Stop())
		}
		errs = append(errs, c.host.restore(ctx), os.RemoveAll(c.Dir))
		c.stopErr = errors.Join(errs...)
	})
	return c.stopErr
}
