package manifest_test

import (
	"encoding/json"
	"fmt"
	"net/netip"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/labels"
)

// toolsFile is the part of toolrunner's tools.json (docs/tools.md) these tests read. The
// file's own rules are the registry's: TestManifestContainersStartWithTheirConfig starts
// toolrunner with it, which refuses a bad file with exit code 2.
type toolsFile struct {
	Sources []struct {
		Name    string                       `json:"name"`
		Kind    string                       `json:"kind"`
		URL     string                       `json:"url"`
		Command string                       `json:"command"`
		Args    []string                     `json:"args"`
		Env     map[string]map[string]string `json:"env"`
		Headers map[string]map[string]string `json:"headers"`
	} `json:"sources"`
}

// toolsConfig returns the tools.json that toolrunner's --tools-config names in the tree:
// the file of the ConfigMap mounted there.
func toolsConfig(t *testing.T, s *set) toolsFile {
	t.Helper()
	d := s.deployments["toolrunner"]
	ctr := container(t, d)
	path := flagArgs(ctr.Args)["tools-config"]
	if path == "" {
		t.Fatal("toolrunner: no --tools-config")
	}
	dir, file := path[:strings.LastIndex(path, "/")], path[strings.LastIndex(path, "/")+1:]
	for _, vm := range ctr.VolumeMounts {
		if vm.MountPath != dir {
			continue
		}
		for _, v := range d.Spec.Template.Spec.Volumes {
			if v.Name == vm.Name && v.ConfigMap != nil {
				cm := s.configMaps[v.ConfigMap.Name]
				if cm == nil {
					t.Fatalf("--tools-config: ConfigMap %s is not in the tree", v.ConfigMap.Name)
				}
				data, ok := cm.Data[file]
				if !ok {
					t.Fatalf("--tools-config=%s: ConfigMap %s has no key %s", path, cm.Name, file)
				}
				return parseTools(t, "ConfigMap "+cm.Name+" "+file, []byte(data))
			}
		}
	}
	t.Fatalf("--tools-config=%s: no ConfigMap is mounted at %s", path, dir)
	return toolsFile{}
}

func parseTools(t *testing.T, name string, data []byte) toolsFile {
	t.Helper()
	var f toolsFile
	if err := json.Unmarshal(data, &f); err != nil {
		t.Fatalf("%s: %v", name, err)
	}
	return f
}

// toolsFromEnv returns the variables of toolrunner's environment that the file's env and
// headers read (from_env).
func toolsFromEnv(f toolsFile) map[string]bool {
	names := map[string]bool{}
	for _, src := range f.Sources {
		for _, m := range []map[string]map[string]string{src.Env, src.Headers} {
			for _, v := range m {
				if n := v["from_env"]; n != "" {
					names[n] = true
				}
			}
		}
	}
	return names
}

// Every source of toolrunner's tools.json is a server of the tree that toolrunner can
// reach: an mcp_http URL names a Service of the tree whose port leads to a container port
// that toolrunner's NetworkPolicies let it reach, or 127.0.0.1 and a port of a container
// in toolrunner's own pod. Every variable the file reads (from_env) is set in toolrunner's
// container from a Secret: never a literal value or a ConfigMap's, which anyone who can
// read the namespace's ConfigMaps or Deployments would see.
func TestToolSourcesAreReachableAndTheirSecretsComeFromSecrets(t *testing.T) {
	each(t, func(t *testing.T, s *set) {
		f := toolsConfig(t, s)
		if strings.Contains(s.tree, "examples/") && len(f.Sources) == 0 {
			t.Fatal("the example adds no source to tools.json")
		}
		d := s.deployments["toolrunner"]
		ctr := container(t, d)
		pods := allPods(s)
		for _, src := range f.Sources {
			at := fmt.Sprintf("tools.json source %q", src.Name)
			switch src.Kind {
			case "mcp_http":
				checkHTTPSource(t, s, pods, at, src.URL)
			case "mcp_stdio":
				t.Errorf("%s: mcp_stdio in curfew's toolrunner image, which has no runtime for it (examples/toolrunner-stdio)", at)
			}
		}
		for name := range toolsFromEnv(f) {
			i := slices.IndexFunc(ctr.Env, func(e corev1.EnvVar) bool { return e.Name == name })
			switch {
			case i < 0:
				t.Errorf("tools.json reads %s, which toolrunner's container does not set (toolrunner would refuse to start)", name)
			case ctr.Env[i].ValueFrom == nil || ctr.Env[i].ValueFrom.SecretKeyRef == nil:
				t.Errorf("tools.json reads %s, which toolrunner's container sets other than from a Secret", name)
			}
		}
	})
}

func checkHTTPSource(t *testing.T, s *set, pods map[string]pod, at, raw string) {
	t.Helper()
	u, err := url.Parse(raw)
	if err != nil || u.Port() == "" || u.Path == "" {
		t.Errorf("%s: url %q: want http://host:port/path", at, raw)
		return
	}
	p, _ := strconv.ParseUint(u.Port(), 10, 16)
	port := int32(p)
	tr := pods["toolrunner"]
	if ip, err := netip.ParseAddr(u.Hostname()); err == nil {
		if !ip.IsLoopback() {
			t.Errorf("%s: url %q: a pod IP is not stable; name a Service", at, raw)
			return
		}
		if !slices.ContainsFunc(tr.ports, func(cp corev1.ContainerPort) bool { return cp.ContainerPort == port }) {
			t.Errorf("%s: url %q: no container of toolrunner's pod serves port %d", at, raw, port)
		}
		return
	}
	host := strings.TrimSuffix(strings.TrimSuffix(u.Hostname(), ".curfew.svc.cluster.local"), ".curfew.svc")
	svc := s.services[host]
	if svc == nil || strings.Contains(host, ".") {
		t.Errorf("%s: url %q: no Service %s in namespace curfew", at, raw, host)
		return
	}
	i := slices.IndexFunc(svc.Spec.Ports, func(sp corev1.ServicePort) bool { return sp.Port == port })
	if i < 0 {
		t.Errorf("%s: url %q: Service %s has no port %d", at, raw, host, port)
		return
	}
	reached := 0
	for name, d := range s.deployments {
		if !labels.SelectorFromSet(svc.Spec.Selector).Matches(labels.Set(d.Spec.Template.Labels)) {
			continue
		}
		reached++
		target := resolve(svc.Spec.Ports[i].TargetPort, container(t, d))
		if target == 0 {
			t.Errorf("%s: Service %s port %d leads to no container port of %s", at, host, port, name)
		} else if !allowed(t, s, tr, pods[name], target) {
			t.Errorf("%s: the NetworkPolicies do not let toolrunner reach %s on port %d", at, name, target)
		}
	}
	if reached == 0 {
		t.Errorf("%s: Service %s selects no Deployment of the tree", at, host)
	}
}

// allPods returns one pod of every Deployment and StatefulSet of the tree (with the ports
// of its sidecars), a client in another namespace, a Prometheus in namespace monitoring
// and a host on the internet.
func allPods(s *set) map[string]pod {
	pods := podsOf(s)
	ip := 100
	for name, d := range s.deployments {
		p, ok := pods[name]
		if !ok {
			ip++
			p = pod{name: name, namespace: "curfew", nsLabels: pods["orchestrator"].nsLabels, labels: d.Spec.Template.Labels,
				ip: netip.MustParseAddr(fmt.Sprintf("10.244.0.%d", ip))}
			for _, c := range d.Spec.Template.Spec.Containers {
				p.ports = append(p.ports, c.Ports...)
			}
		}
		for _, c := range d.Spec.Template.Spec.InitContainers {
			if c.RestartPolicy != nil && *c.RestartPolicy == corev1.ContainerRestartPolicyAlways {
				p.ports = append(p.ports, c.Ports...)
			}
		}
		pods[name] = p
	}
	pods["monitoring"] = pod{name: "monitoring", namespace: "monitoring", nsLabels: map[string]string{"kubernetes.io/metadata.name": "monitoring"},
		labels: map[string]string{"app.kubernetes.io/name": "prometheus"}, ip: netip.MustParseAddr("10.244.2.9")}
	pods["internet"] = pod{name: "internet", namespace: "-", ip: netip.MustParseAddr("203.0.113.7"),
		ports: []corev1.ContainerPort{{Name: "https", ContainerPort: 443}}}
	return pods
}

// edges returns every connection the tree's NetworkPolicies allow between its pods (and
// the outsiders of allPods), to each port a container of the destination declares, as
// "from → to:port".
func edges(t *testing.T, s *set) []string {
	t.Helper()
	pods := allPods(s)
	var out []string
	for _, from := range pods {
		for _, to := range pods {
			for _, cp := range to.ports {
				if from.name != to.name && allowed(t, s, from, to, cp.ContainerPort) {
					out = append(out, fmt.Sprintf("%s → %s:%d", from.name, to.name, cp.ContainerPort))
				}
			}
		}
	}
	slices.Sort(out)
	return slices.Compact(out)
}

// exampleEdges are the connections each tool server example adds to its overlay's: the
// HTTP server's Deployment is reached by toolrunner on its MCP port and by no one else,
// and reaches no one; the sidecar, on toolrunner's loopback, adds none.
var exampleEdges = map[string][]string{
	"examples/mcp-http":    {"toolrunner → team-search-mcp:8080"},
	"examples/mcp-sidecar": nil,
	// The web console's component opens the orchestrators' console port to the ingress
	// controller's namespace only: no connection between the mesh's pods.
	"components/console": nil,
}

// A tool server example opens exactly the connections it needs: comparing every
// connection the NetworkPolicies allow with the example and without it (its overlay
// alone), the only difference is toolrunner's to the server; no connection is lost.
func TestToolServerExamplesOpenOnlyTheirServersPort(t *testing.T) {
	for _, tree := range trees {
		overlay, comps, ok := strings.Cut(tree, "+")
		if !ok {
			continue
		}
		with, without := render(t)[tree], render(t)[overlay]
		t.Run(with.tree, func(t *testing.T) {
			before, after := edges(t, without), edges(t, with)
			var added, lost []string
			for _, e := range after {
				if !slices.Contains(before, e) {
					added = append(added, e)
				}
			}
			for _, e := range before {
				if !slices.Contains(after, e) {
					lost = append(lost, e)
				}
			}
			var want []string
			for _, c := range strings.Split(comps, "+") {
				ex, ok := exampleEdges[strings.ReplaceAll(c, "../", "")]
				if !ok {
					t.Fatalf("exampleEdges has no entry for %s", c)
				}
				want = append(want, ex...)
			}
			slices.Sort(want)
			if !slices.Equal(added, want) {
				t.Errorf("the example allows the new connections\n  %q\nwant exactly\n  %q", added, want)
			}
			if len(lost) > 0 {
				t.Errorf("the example closes connections of its overlay: %q", lost)
			}
			if len(before) == 0 || !slices.Contains(after, "orchestrator → toolrunner:7702") {
				t.Fatalf("the edges cannot be right: %d before, %q after", len(before), after)
			}
		})
	}
}
