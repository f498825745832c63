package manifest_test

import (
	"fmt"
	"net"
	"strconv"
	"strings"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/util/intstr"
)

// stopFlush is what a stop takes beyond --drain-delay and --shutdown-grace (the final
// flush of spans and logs, docs/leases.md#drain).
const stopFlush = 2 * time.Second

// Every container, curfew's and the dev overlay's PostgreSQL and NATS alike, has probes,
// requests and limits, and the restricted security context.
func TestEveryContainerHasProbesLimitsAndSecurityContext(t *testing.T) {
	each(t, func(t *testing.T, s *set) {
		pods := map[string]corev1.PodSpec{}
		for _, d := range s.deployments {
			pods["Deployment "+d.Name] = d.Spec.Template.Spec
		}
		for _, st := range s.statefulSets {
			pods["StatefulSet "+st.Name] = st.Spec.Template.Spec
		}
		for name, p := range pods {
			checkPod(t, name, p)
		}
	})
}

func checkPod(t *testing.T, name string, p corev1.PodSpec) {
	t.Helper()
	if p.AutomountServiceAccountToken == nil || *p.AutomountServiceAccountToken {
		t.Errorf("%s: automountServiceAccountToken must be false (curfew never calls the Kubernetes API)", name)
	}
	psc := p.SecurityContext
	if psc == nil {
		psc = &corev1.PodSecurityContext{}
	}
	all := append(append([]corev1.Container{}, p.InitContainers...), p.Containers...)
	if len(all) == 0 {
		t.Errorf("%s: no containers", name)
	}
	for _, c := range all {
		at := fmt.Sprintf("%s container %s", name, c.Name)
		if c.ReadinessProbe == nil || c.LivenessProbe == nil {
			t.Errorf("%s: needs readiness and liveness probes", at)
		}
		for _, r := range []corev1.ResourceName{corev1.ResourceCPU, corev1.ResourceMemory} {
			req, lim := c.Resources.Requests[r], c.Resources.Limits[r]
			if req.IsZero() || lim.IsZero() {
				t.Errorf("%s: needs a %s request and limit", at, r)
			} else if req.Cmp(lim) > 0 {
				t.Errorf("%s: %s request %s above its limit %s", at, r, req.String(), lim.String())
			}
		}
		sc := c.SecurityContext
		if sc == nil {
			t.Errorf("%s: no securityContext", at)
			continue
		}
		nonRoot := sc.RunAsNonRoot
		if nonRoot == nil {
			nonRoot = psc.RunAsNonRoot
		}
		if nonRoot == nil || !*nonRoot {
			t.Errorf("%s: runAsNonRoot must be true", at)
		}
		if uid := firstNonNil(sc.RunAsUser, psc.RunAsUser); uid == nil || *uid == 0 {
			t.Errorf("%s: needs a non-zero runAsUser (an image's USER is not checked by runAsNonRoot when it is a name)", at)
		}
		if sc.ReadOnlyRootFilesystem == nil || !*sc.ReadOnlyRootFilesystem {
			t.Errorf("%s: readOnlyRootFilesystem must be true", at)
		}
		if sc.AllowPrivilegeEscalation == nil || *sc.AllowPrivilegeEscalation {
			t.Errorf("%s: allowPrivilegeEscalation must be false", at)
		}
		if sc.Capabilities == nil || len(sc.Capabilities.Drop) != 1 || sc.Capabilities.Drop[0] != "ALL" || len(sc.Capabilities.Add) != 0 {
			t.Errorf("%s: capabilities must drop ALL and add none", at)
		}
		sp := sc.SeccompProfile
		if sp == nil {
			sp = psc.SeccompProfile
		}
		if sp == nil || sp.Type != corev1.SeccompProfileTypeRuntimeDefault {
			t.Errorf("%s: seccompProfile must be RuntimeDefault", at)
		}
		if sc.Privileged != nil && *sc.Privileged {
			t.Errorf("%s: privileged", at)
		}
	}
}

func firstNonNil[T any](a ...*T) *T {
	for _, p := range a {
		if p != nil {
			return p
		}
	}
	return nil
}

// Each curfew Deployment: at least 2 replicas, native gRPC probes, topology spread, a
// PodDisruptionBudget, a HorizontalPodAutoscaler and a headless Service.
func TestEveryServiceIsReplicatedAndProtected(t *testing.T) {
	each(t, func(t *testing.T, s *set) {
		for _, c := range components {
			d := s.deployments[c]
			if d == nil {
				t.Fatalf("no Deployment of %s", c)
			}
			if d.Spec.Replicas == nil || *d.Spec.Replicas < 2 {
				t.Errorf("%s: want at least 2 replicas", c)
			}
			if ru := d.Spec.Strategy.RollingUpdate; ru == nil || ru.MaxUnavailable == nil || ru.MaxUnavailable.IntValue() != 0 {
				t.Errorf("%s: a rolling update must not take a replica down before its successor is ready (maxUnavailable 0)", c)
			}
			ctr := container(t, d)
			for _, p := range []*corev1.Probe{ctr.ReadinessProbe, ctr.LivenessProbe} {
				if p == nil || p.GRPC == nil {
					t.Errorf("%s: readiness and liveness must be native gRPC probes", c)
				}
			}
			spread := map[string]bool{}
			for _, tsc := range d.Spec.Template.Spec.TopologySpreadConstraints {
				if tsc.LabelSelector != nil && selects(t, tsc.LabelSelector, d.Spec.Template.Labels) {
					spread[tsc.TopologyKey] = true
				}
			}
			if !spread["kubernetes.io/hostname"] {
				t.Errorf("%s: no topology spread across nodes", c)
			}
			pdb := 0
			for _, p := range s.pdbs {
				if p.Spec.Selector != nil && selects(t, p.Spec.Selector, d.Spec.Template.Labels) {
					pdb++
					if p.Spec.MinAvailable == nil && p.Spec.MaxUnavailable == nil {
						t.Errorf("%s: PDB %s sets neither minAvailable nor maxUnavailable", c, p.Name)
					}
				}
			}
			if pdb != 1 {
				t.Errorf("%s: %d PodDisruptionBudgets select it, want 1", c, pdb)
			}
			hpa := 0
			for _, h := range s.hpas {
				ref := h.Spec.ScaleTargetRef
				if ref.Kind == "Deployment" && ref.Name == d.Name {
					hpa++
					if h.Spec.MinReplicas == nil || *h.Spec.MinReplicas < *d.Spec.Replicas || h.Spec.MaxReplicas < *h.Spec.MinReplicas {
						t.Errorf("%s: HPA %s must keep at least the Deployment's %d replicas", c, h.Name, *d.Spec.Replicas)
					}
					if len(h.Spec.Metrics) == 0 {
						t.Errorf("%s: HPA %s has no metric", c, h.Name)
					}
				}
			}
			if hpa != 1 {
				t.Errorf("%s: %d HorizontalPodAutoscalers target it, want 1", c, hpa)
			}
			if svc := s.services["curfew-"+c]; svc == nil || svc.Spec.ClusterIP != corev1.ClusterIPNone ||
				!labels.SelectorFromSet(svc.Spec.Selector).Matches(labels.Set(d.Spec.Template.Labels)) {
				t.Errorf("%s: needs a headless Service curfew-%s selecting its pods", c, c)
			}
		}
		api := s.services["curfew-api"]
		if api == nil || api.Spec.ClusterIP == corev1.ClusterIPNone || api.Spec.Type != corev1.ServiceTypeClusterIP ||
			!labels.SelectorFromSet(api.Spec.Selector).Matches(labels.Set(s.deployments["orchestrator"].Spec.Template.Labels)) {
			t.Error("the orchestrator needs a ClusterIP Service, curfew-api, for callers")
		}
	})
}

// Ports agree: a service's --addr, its container port "grpc" and its Services; its
// --health-addr, container port "health" and both probes; its --admin-addr, container port "admin" and the scrape annotation; and
// every client flag (--toolrunner=dns:///curfew-toolrunner:7702, …) names a Service port
// that reaches the callee's gRPC port.
func TestPortsInServicesProbesAndFlagsAgree(t *testing.T) {
	each(t, func(t *testing.T, s *set) {
		grpcPort := map[string]int32{}
		for _, c := range components {
			d := s.deployments[c]
			ctr := container(t, d)
			args := flagArgs(ctr.Args)
			addr, admin := port(t, c, "--addr", args["addr"]), port(t, c, "--admin-addr", args["admin-addr"])
			grpcPort[c] = addr
			if got := containerPort(ctr, "grpc"); got != addr {
				t.Errorf("%s: container port grpc %d, --addr %d", c, got, addr)
			}
			if got := containerPort(ctr, "admin"); got != admin {
				t.Errorf("%s: container port admin %d, --admin-addr %d", c, got, admin)
			}
			// The probes ask the plaintext health listener: the kubelet cannot do mTLS.
			health := port(t, c, "--health-addr", args["health-addr"])
			if got := containerPort(ctr, "health"); got != health {
				t.Errorf("%s: container port health %d, --health-addr %d", c, got, health)
			}
			for name, p := range map[string]*corev1.Probe{"readiness": ctr.ReadinessProbe, "liveness": ctr.LivenessProbe} {
				if p != nil && p.GRPC != nil && p.GRPC.Port != health {
					t.Errorf("%s: %s probe on %d, --health-addr %d", c, name, p.GRPC.Port, health)
				}
			}
			if a, ok := d.Spec.Template.Annotations["prometheus.io/port"]; ok && a != strconv.Itoa(int(admin)) {
				t.Errorf("%s: prometheus.io/port %s, --admin-addr %d", c, a, admin)
			}
		}
		for _, svc := range s.services {
			c := svc.Spec.Selector["app.kubernetes.io/name"]
			d := s.deployments[c]
			if d == nil {
				continue // the dev overlay's PostgreSQL and NATS
			}
			for _, sp := range svc.Spec.Ports {
				if target := resolve(sp.TargetPort, container(t, d)); target == 0 {
					t.Errorf("Service %s port %s: targetPort %s is no container port of %s", svc.Name, sp.Name, sp.TargetPort.String(), c)
				} else if sp.Name == "grpc" && target != grpcPort[c] {
					t.Errorf("Service %s port grpc reaches %d, %s serves gRPC on %d", svc.Name, target, c, grpcPort[c])
				}
			}
		}
		for caller, callees := range flagGraph(t, s) {
			args := flagArgs(container(t, s.deployments[caller]).Args)
			for callee := range callees {
				if callee == caller {
					continue // CancelRun forwarding: checked below
				}
				target := args[callee]
				host, p := dnsTarget(t, caller, callee, target)
				svc := s.services[host]
				if svc == nil {
					t.Errorf("%s --%s=%s: no Service %s", caller, callee, target, host)
					continue
				}
				if svc.Spec.Selector["app.kubernetes.io/name"] != callee {
					t.Errorf("%s --%s=%s: Service %s does not select %s", caller, callee, target, host, callee)
				}
				found := false
				for _, sp := range svc.Spec.Ports {
					if sp.Port == p {
						found = true
						if got := resolve(sp.TargetPort, container(t, s.deployments[callee])); got != grpcPort[callee] {
							t.Errorf("%s --%s=%s reaches port %d, %s serves gRPC on %d", caller, callee, target, got, callee, grpcPort[callee])
						}
					}
				}
				if !found {
					t.Errorf("%s --%s=%s: Service %s has no port %d", caller, callee, target, host, p)
				}
			}
		}
	})
}

// The orchestrator advertises its pod's gRPC port for CancelRun forwarding.
func TestOrchestratorAdvertisesItsGRPCPort(t *testing.T) {
	each(t, func(t *testing.T, s *set) {
		ctr := container(t, s.deployments["orchestrator"])
		adv := envOf(t, s, ctr, nil)["CURFEW_ADVERTISE_ADDR"]
		host, p, err := net.SplitHostPort(adv)
		if err != nil || host != podIP {
			t.Fatalf("CURFEW_ADVERTISE_ADDR %q; want the pod IP and gRPC port", adv)
		}
		if want := strconv.Itoa(int(containerPort(ctr, "grpc"))); p != want {
			t.Errorf("CURFEW_ADVERTISE_ADDR port %s, the gRPC port is %s", p, want)
		}
	})
}

// The stop of a draining process (--drain-delay + --shutdown-grace + the flush) ends
// before the kubelet's SIGKILL, and before the liveness probe would restart it.
func TestDrainFitsTheGracePeriod(t *testing.T) {
	each(t, func(t *testing.T, s *set) {
		for _, c := range components {
			d := s.deployments[c]
			ctr := container(t, d)
			args := flagArgs(ctr.Args)
			drain, grace := duration(t, c, "--drain-delay", args["drain-delay"]), duration(t, c, "--shutdown-grace", args["shutdown-grace"])
			if drain <= 0 {
				t.Errorf("%s: --drain-delay must be set so endpoints move away before the listener closes", c)
			}
			bound := drain + grace + stopFlush
			tgps := d.Spec.Template.Spec.TerminationGracePeriodSeconds
			if tgps == nil || time.Duration(*tgps)*time.Second <= bound {
				t.Errorf("%s: terminationGracePeriodSeconds must exceed the stop bound %v", c, bound)
			}
			lp := ctr.LivenessProbe
			if lp != nil && time.Duration(lp.PeriodSeconds*lp.FailureThreshold)*time.Second < bound {
				t.Errorf("%s: liveness gives up after %ds, before a stop's bound %v", c, lp.PeriodSeconds*lp.FailureThreshold, bound)
			}
		}
	})
}

func container(t *testing.T, d *appsv1.Deployment) corev1.Container {
	t.Helper()
	for _, c := range d.Spec.Template.Spec.Containers {
		if c.Name == d.Spec.Template.Labels["app.kubernetes.io/name"] {
			return c
		}
	}
	t.Fatalf("Deployment %s has no container named after its component", d.Name)
	return corev1.Container{}
}

// flagArgs maps each --name=value argument to its value.
func flagArgs(args []string) map[string]string {
	m := map[string]string{}
	for _, a := range args {
		if name, v, ok := strings.Cut(strings.TrimLeft(a, "-"), "="); ok {
			m[name] = v
		} else {
			m[name] = "true"
		}
	}
	return m
}

func port(t *testing.T, c, flag, addr string) int32 {
	t.Helper()
	_, p, err := net.SplitHostPort(addr)
	n, err2 := strconv.ParseUint(p, 10, 16)
	if err != nil || err2 != nil || n == 0 {
		t.Fatalf("%s: %s=%q is not host:port with a fixed port", c, flag, addr)
	}
	return int32(n)
}

func duration(t *testing.T, c, flag, v string) time.Duration {
	t.Helper()
	d, err := time.ParseDuration(v)
	if err != nil {
		t.Fatalf("%s: %s=%q: %v (the manifest must set it)", c, flag, v, err)
	}
	return d
}

func containerPort(c corev1.Container, name string) int32 {
	for _, p := range c.Ports {
		if p.Name == name {
			return p.ContainerPort
		}
	}
	return 0
}

// resolve returns the container port a Service's or NetworkPolicy's port names, or 0.
func resolve(p intstr.IntOrString, c corev1.Container) int32 {
	if p.Type == intstr.String {
		return containerPort(c, p.StrVal)
	}
	for _, cp := range c.Ports {
		if cp.ContainerPort == p.IntVal {
			return cp.ContainerPort
		}
	}
	return 0
}

// dnsTarget splits a client flag's dns:///host:port target.
func dnsTarget(t *testing.T, caller, callee, target string) (string, int32) {
	t.Helper()
	rest, ok := strings.CutPrefix(target, "dns:///")
	if !ok {
		t.Fatalf("%s --%s=%q: want a dns:/// target, so that the client balances over the headless Service's pods", caller, callee, target)
	}
	host, p, err := net.SplitHostPort(rest)
	n, err2 := strconv.ParseUint(p, 10, 16)
	if err != nil || err2 != nil {
		t.Fatalf("%s --%s=%q: not dns:///host:port", caller, callee, target)
	}
	return host, int32(n)
}

func selects(t *testing.T, ls *metav1.LabelSelector, l map[string]string) bool {
	t.Helper()
	sel, err := metav1.LabelSelectorAsSelector(ls)
	if err != nil {
		t.Fatalf("label selector %v: %v", ls, err)
	}
	return sel.Matches(labels.Set(l))
}

// Every curfew service runs mTLS: --tls-dir names the mount of a Secret
// curfew-tls-<service> of its own, read-only and unreadable by others (it holds the key),
// and no container runs --insecure.
func TestEveryServiceRunsMTLS(t *testing.T) {
	each(t, func(t *testing.T, s *set) {
		for _, c := range components {
			d := s.deployments[c]
			ctr := container(t, d)
			args := flagArgs(ctr.Args)
			if _, ok := args["insecure"]; ok {
				t.Errorf("%s runs --insecure", c)
			}
			dir := args["tls-dir"]
			if dir == "" {
				t.Errorf("%s: no --tls-dir", c)
				continue
			}
			var mount *corev1.VolumeMount
			for i := range ctr.VolumeMounts {
				if ctr.VolumeMounts[i].MountPath == dir {
					mount = &ctr.VolumeMounts[i]
				}
			}
			if mount == nil || !mount.ReadOnly {
				t.Errorf("%s: --tls-dir %s is not a read-only mount", c, dir)
				continue
			}
			var secret *corev1.SecretVolumeSource
			for _, v := range d.Spec.Template.Spec.Volumes {
				if v.Name == mount.Name {
					secret = v.Secret
				}
			}
			if secret == nil || secret.SecretName != "curfew-tls-"+c {
				t.Errorf("%s: --tls-dir is not the Secret curfew-tls-%s", c, c)
				continue
			}
			// Optional, the pod would start without its certificate and fail at its first
			// TLS handshake instead of waiting for the Secret.
			if secret.Optional != nil && *secret.Optional {
				t.Errorf("%s: the TLS Secret curfew-tls-%s is optional", c, c)
			}
			// 0440 (the process reads it through its group, fsGroup): written in octal in
			// YAML, it must not have been read as decimal 440 (0670, writable).
			if secret.DefaultMode == nil || *secret.DefaultMode != 0o440 {
				t.Errorf("%s: the TLS Secret's files must have mode 0440 (defaultMode %v)", c, secret.DefaultMode)
			}
		}
	})
}

// In dev there are no provider keys (the sim model only): modelproxy's provider-keys Secret
// is optional there, and required wherever a tree does not say otherwise.
func TestProviderKeysOptionalInDevOnly(t *testing.T) {
	each(t, func(t *testing.T, s *set) {
		d := s.deployments["modelproxy"]
		var keys *corev1.SecretVolumeSource
		for _, v := range d.Spec.Template.Spec.Volumes {
			if v.Secret != nil && v.Secret.SecretName == "curfew-provider-keys" {
				keys = v.Secret
			}
		}
		if keys == nil {
			t.Fatal("modelproxy mounts no curfew-provider-keys Secret")
		}
		optional := keys.Optional != nil && *keys.Optional
		if dev := strings.HasPrefix(s.tree, "overlays/dev"); optional != dev {
			t.Errorf("curfew-provider-keys optional: %v, want %v", optional, dev)
		}
	})
}
