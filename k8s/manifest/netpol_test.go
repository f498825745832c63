package manifest_test

import (
	"fmt"
	"maps"
	"net/netip"
	"slices"
	"testing"

	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
)

// callGraph is DESIGN.md's: who may call whom inside the mesh. "client" is any caller
// outside it.
var callGraph = map[string][]string{
	"client":       {"orchestrator"},
	"orchestrator": {"orchestrator", "toolrunner", "subagent", "modelproxy"}, // itself: CancelRun forwarding
	"toolrunner":   {"subagent"},
	"subagent":     {"toolrunner", "modelproxy"},
	"modelproxy":   nil,
}

// storeUsers are the services with a --store, the only ones that may reach PostgreSQL.
var storeUsers = []string{"orchestrator", "toolrunner", "modelproxy"}

// pod is a pod as NetworkPolicies see it.
type pod struct {
	name      string
	namespace string
	nsLabels  map[string]string
	labels    map[string]string
	ip        netip.Addr
	ports     []corev1.ContainerPort
}

// The NetworkPolicies allow exactly the call graph: each edge is open on the callee's
// gRPC port (egress of the caller and ingress of the callee), every other pair of curfew
// pods, and any outsider calling anything but the orchestrator, is denied. The graph the
// services' own client flags configure is the same graph.
func TestNetworkPolicyGraphIsTheCallGraph(t *testing.T) {
	each(t, func(t *testing.T, s *set) {
		want := map[string][]string{}
		for k, v := range callGraph {
			want[k] = slices.Sorted(slices.Values(v))
		}
		flags := map[string][]string{"client": {"orchestrator"}}
		for caller, callees := range flagGraph(t, s) {
			flags[caller] = slices.Sorted(maps.Keys(callees))
		}
		for _, c := range components {
			if flags[c] == nil {
				flags[c] = nil
			}
		}
		if !maps.EqualFunc(flags, want, slices.Equal) {
			t.Errorf("the services' client flags configure\n  %v\nDESIGN.md's call graph is\n  %v", flags, want)
		}

		pods := podsOf(s)
		got := map[string][]string{}
		for _, from := range append([]string{"client"}, components...) {
			got[from] = nil
			for _, to := range components {
				if allowed(t, s, pods[from], pods[to], grpcPortOf(pods[to])) {
					got[from] = append(got[from], to)
				}
			}
			slices.Sort(got[from])
		}
		if !maps.EqualFunc(got, want, slices.Equal) {
			t.Errorf("the NetworkPolicies allow\n  %v\nthe call graph is\n  %v", got, want)
		}
		// Outsiders reach no admin port unless the Prometheus component lets its
		// namespace in; mesh peers never call each other's admin ports.
		for _, to := range components {
			admin := portNamed(pods[to], "admin")
			for _, from := range components {
				if allowed(t, s, pods[from], pods[to], admin) {
					t.Errorf("%s may reach %s's admin port", from, to)
				}
			}
			if allowed(t, s, pods["client"], pods[to], admin) {
				t.Errorf("an outsider may reach %s's admin port", to)
			}
		}
		if pg, ok := pods["postgres"]; ok { // the dev overlay's store
			var reach []string
			for _, from := range components {
				if allowed(t, s, pods[from], pg, 5432) {
					reach = append(reach, from)
				}
			}
			if slices.Sort(reach); !slices.Equal(reach, slices.Sorted(slices.Values(storeUsers))) {
				t.Errorf("PostgreSQL is reachable from %v, want exactly the store users %v", reach, storeUsers)
			}
			if allowed(t, s, pods["client"], pg, 5432) {
				t.Error("PostgreSQL is reachable from outside curfew")
			}
		}
		if nats, ok := pods["nats"]; ok {
			for _, from := range append([]string{"client"}, components...) {
				if got, want := allowed(t, s, pods[from], nats, 4222), from == "orchestrator"; got != want {
					t.Errorf("%s → NATS allowed %v, want %v (only the orchestrator publishes dead letters)", from, got, want)
				}
			}
		}
		// The mesh may leave the cluster only where it has to: modelproxy to the
		// providers over HTTPS; no one else reaches the internet.
		internet := pod{name: "internet", ip: netip.MustParseAddr("203.0.113.7"), namespace: "-"}
		for _, from := range components {
			if got, want := egressAllowed(t, s, pods[from], internet, 443), from == "modelproxy"; got != want {
				t.Errorf("%s → internet:443 allowed %v, want %v", from, got, want)
			}
		}
	})
}

// flagGraph is the call graph the Deployments' client flags configure: caller → callees.
func flagGraph(t *testing.T, s *set) map[string]map[string]bool {
	t.Helper()
	g := map[string]map[string]bool{}
	for _, caller := range components {
		args := flagArgs(container(t, s.deployments[caller]).Args)
		g[caller] = map[string]bool{}
		for _, callee := range components {
			if _, ok := args[callee]; ok {
				g[caller][callee] = true
			}
		}
		if caller == "orchestrator" && envOf(t, s, container(t, s.deployments[caller]), nil)["CURFEW_ADVERTISE_ADDR"] != "" {
			g[caller][caller] = true // leases name its address: CancelRun is forwarded to a run's owner
		}
	}
	return g
}

// podsOf returns one pod of each curfew component, of the dev overlay's PostgreSQL and
// NATS when present, and an outside client in another namespace.
func podsOf(s *set) map[string]pod {
	nsLabels := map[string]string{"kubernetes.io/metadata.name": "curfew"}
	for _, ns := range s.namespaces {
		for k, v := range ns.Labels {
			nsLabels[k] = v
		}
	}
	pods := map[string]pod{}
	ip := 10
	add := func(name string, l map[string]string, c []corev1.Container) {
		var ports []corev1.ContainerPort
		for _, ctr := range c {
			ports = append(ports, ctr.Ports...)
		}
		ip++
		pods[name] = pod{name: name, namespace: "curfew", nsLabels: nsLabels, labels: l, ports: ports,
			ip: netip.MustParseAddr(fmt.Sprintf("10.244.0.%d", ip))}
	}
	for _, c := range components {
		d := s.deployments[c]
		add(c, d.Spec.Template.Labels, d.Spec.Template.Spec.Containers)
	}
	for _, st := range s.statefulSets {
		add(st.Spec.Template.Labels["app.kubernetes.io/name"], st.Spec.Template.Labels, st.Spec.Template.Spec.Containers)
	}
	pods["client"] = pod{name: "client", namespace: "apps", nsLabels: map[string]string{"kubernetes.io/metadata.name": "apps"},
		labels: map[string]string{"app": "agent-platform"}, ip: netip.MustParseAddr("10.244.1.9")}
	return pods
}

func grpcPortOf(p pod) int32 { return portNamed(p, "grpc") }

func portNamed(p pod, name string) int32 {
	for _, cp := range p.ports {
		if cp.Name == name {
			return cp.ContainerPort
		}
	}
	return 0
}

// allowed reports whether a TCP connection from → to:port passes both the egress
// policies of from and the ingress policies of to, with Kubernetes' semantics: a pod no
// policy of a direction selects is open in that direction; otherwise one rule of one
// selecting policy must allow it. Only curfew's namespace has policies here; an outside
// pod's egress is open.
func allowed(t *testing.T, s *set, from, to pod, port int32) bool {
	t.Helper()
	return egressAllowed(t, s, from, to, port) && ingressAllowed(t, s, from, to, port)
}

func egressAllowed(t *testing.T, s *set, from, to pod, port int32) bool {
	t.Helper()
	if from.namespace != "curfew" {
		return true
	}
	selected := false
	for _, np := range s.policies {
		if !hasType(np, networkingv1.PolicyTypeEgress) || !selects(t, &np.Spec.PodSelector, from.labels) {
			continue
		}
		selected = true
		for _, r := range np.Spec.Egress {
			if peersMatch(t, r.To, to) && portsMatch(r.Ports, to, port) {
				return true
			}
		}
	}
	return !selected
}

func ingressAllowed(t *testing.T, s *set, from, to pod, port int32) bool {
	t.Helper()
	if to.namespace != "curfew" {
		return true
	}
	selected := false
	for _, np := range s.policies {
		if !hasType(np, networkingv1.PolicyTypeIngress) || !selects(t, &np.Spec.PodSelector, to.labels) {
			continue
		}
		selected = true
		for _, r := range np.Spec.Ingress {
			if peersMatch(t, r.From, from) && portsMatch(r.Ports, to, port) {
				return true
			}
		}
	}
	return !selected
}

func hasType(np *networkingv1.NetworkPolicy, pt networkingv1.PolicyType) bool {
	if len(np.Spec.PolicyTypes) == 0 { // the API's default: Ingress, plus Egress if it has rules
		return pt == networkingv1.PolicyTypeIngress || len(np.Spec.Egress) > 0
	}
	return slices.Contains(np.Spec.PolicyTypes, pt)
}

// peersMatch: no peers means every peer.
func peersMatch(t *testing.T, peers []networkingv1.NetworkPolicyPeer, p pod) bool {
	t.Helper()
	if len(peers) == 0 {
		return true
	}
	for _, peer := range peers {
		switch {
		case peer.IPBlock != nil:
			if ipBlockMatches(t, peer.IPBlock, p.ip) {
				return true
			}
		case peer.NamespaceSelector != nil:
			if p.nsLabels != nil && selects(t, peer.NamespaceSelector, p.nsLabels) &&
				(peer.PodSelector == nil || selects(t, peer.PodSelector, p.labels)) {
				return true
			}
		case peer.PodSelector != nil: // the policy's own namespace
			if p.namespace == "curfew" && selects(t, peer.PodSelector, p.labels) {
				return true
			}
		}
	}
	return false
}

func ipBlockMatches(t *testing.T, b *networkingv1.IPBlock, ip netip.Addr) bool {
	t.Helper()
	in := func(cidr string) bool {
		pfx, err := netip.ParsePrefix(cidr)
		if err != nil {
			t.Fatalf("ipBlock %q: %v", cidr, err)
		}
		return pfx.Contains(ip)
	}
	if !in(b.CIDR) {
		return false
	}
	for _, e := range b.Except {
		if in(e) {
			return false
		}
	}
	return true
}

// portsMatch: no ports means every port; a named port is the destination pod's.
func portsMatch(ports []networkingv1.NetworkPolicyPort, to pod, port int32) bool {
	if len(ports) == 0 {
		return true
	}
	for _, p := range ports {
		if p.Protocol != nil && *p.Protocol != corev1.ProtocolTCP {
			continue
		}
		if p.Port == nil {
			return true
		}
		n := p.Port.IntVal
		if p.Port.StrVal != "" {
			n = portNamed(to, p.Port.StrVal)
			if n == 0 {
				continue
			}
		}
		end := n
		if p.EndPort != nil {
			end = *p.EndPort
		}
		if port >= n && port <= end {
			return true
		}
	}
	return false
}
