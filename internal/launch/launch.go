package launch

import (
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
)

// Services are the four services in start order: each one's callees come before it.
var Services = []string{"modelproxy", "subagent", "toolrunner", "orchestrator"}

// portOffset is each service's first port above the base port: its gRPC port, with its
// admin port next to it.
var portOffset = map[string]int{"orchestrator": 0, "toolrunner": 2, "subagent": 4, "modelproxy": 6}

// openAIOffset is the orchestrator's OpenAI-compatible API's port above the base port.
const openAIOffset = 8

// consoleOffset is the orchestrator's web console's port, base+9.
const consoleOffset = 9

// peers are the services each service calls, with the flag that names each one.
var peers = map[string][]string{
	"orchestrator": {"modelproxy", "toolrunner", "subagent"},
	"toolrunner":   {"subagent"},
	"subagent":     {"modelproxy", "toolrunner"},
}

// Endpoint is where one service listens.
type Endpoint struct {
	Addr      string `json:"addr"`
	AdminAddr string `json:"admin_addr"`
	// OpenAIAddr is the orchestrator's OpenAI-compatible API (--openai-addr); other
	// services have none.
	OpenAIAddr string `json:"openai_addr,omitempty"`
	// ConsoleAddr is the orchestrator's web console (--console-addr); other services
	// have none.
	ConsoleAddr string `json:"console_addr,omitempty"`
	PID         int    `json:"pid"` // 0 until the process has started
}

// Allocate assigns every service its gRPC and admin address on 127.0.0.1 (and the
// orchestrator its OpenAI-compatible API's, base+8, and its web console's, base+9): base, base+1,
// ... in the fixed layout of `curfew up --base-port` (the orchestrator on base), or free
// ports when base is 0. A free port is released before the service binds it, so another
// process may take it meanwhile.
func Allocate(base int) (map[string]Endpoint, error) {
	eps := map[string]Endpoint{}
	for _, name := range Services {
		ports := []int{0, 0}
		if name == "orchestrator" {
			ports = append(ports, 0, 0)
		}
		for i := range ports {
			if base != 0 {
				ports[i] = base + portOffset[name] + i
				switch i {
				case 2:
					ports[i] = base + openAIOffset
				case 3:
					ports[i] = base + consoleOffset
				}
				continue
			}
			l, err := net.Listen("tcp", "127.0.0.1:0") //nolint:noctx // a local bind, nothing to cancel
			if err != nil {
				return nil, fmt.Errorf("pick a free port: %w", err)
			}
			ports[i] = l.Addr().(*net.TCPAddr).Port
			defer l.Close() // hold every port until all are picked, so none repeats
		}
		ep := Endpoint{Addr: "127.0.0.1:" + strconv.Itoa(ports[0]), AdminAddr: "127.0.0.1:" + strconv.Itoa(ports[1])}
		if len(ports) > 2 {
			ep.OpenAIAddr = "127.0.0.1:" + strconv.Itoa(ports[2])
			ep.ConsoleAddr = "127.0.0.1:" + strconv.Itoa(ports[3])
		}
		eps[name] = ep
	}
	return eps, nil
}

// PeerFlags are the flags that tell service where the services it calls listen
// (--modelproxy ADDR, ...), from eps; a peer absent from eps is left out.
func PeerFlags(service string, eps map[string]Endpoint) []string {
	var args []string
	for _, p := range peers[service] {
		if ep, ok := eps[p]; ok {
			args = append(args, "--"+p, ep.Addr)
		}
	}
	return args
}

// FindBinaries returns the path of every service's binary: in dir, else (dir "") next
// to the running executable, else on $PATH.
func FindBinaries(dir string) (map[string]string, error) {
	if dir == "" {
		if exe, err := os.Executable(); err == nil {
			dir = filepath.Dir(exe)
		}
	}
	out := map[string]string{}
	for _, name := range Services {
		p := filepath.Join(dir, name)
		if st, err := os.Stat(p); err == nil && !st.IsDir() {
			out[name] = p
			continue
		}
		lp, err := exec.LookPath(name)
		if err != nil {
			return nil, fmt.Errorf("service binary %q not found in %s nor on $PATH (build them with `make build`, or pass --bin-dir)", name, dir)
		}
		out[name] = lp
	}
	return out, nil
}
