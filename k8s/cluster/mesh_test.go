package cluster_test

import (
	"bufio"
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"

	"github.com/curfew-mesh/curfew/k8s/cluster"
)

// buildCLI builds the curfew CLI from the repository (its workspace), for `curfew tls`.
func buildCLI(ctx context.Context, t *testing.T, root string) string {
	t.Helper()
	bin := filepath.Join(t.TempDir(), "curfew")
	cmd := exec.CommandContext(ctx, "go", "build", "-o", bin, "./cmd/curfew")
	cmd.Dir = root
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("go build ./cmd/curfew: %v\n%s", err, out)
	}
	return bin
}

// meshTLS makes the mesh's certificates as docs/kubernetes.md tells a user to (curfew tls
// init, then curfew tls k8s-secrets | kubectl apply -f -) and returns the directory.
func meshTLS(ctx context.Context, t *testing.T, c *cluster.Cluster, cli string) string {
	t.Helper()
	dir := filepath.Join(t.TempDir(), "tls")
	if out, err := exec.CommandContext(ctx, cli, "tls", "init", dir).CombinedOutput(); err != nil {
		t.Fatalf("curfew tls init: %v\n%s", err, out)
	}
	secrets, err := exec.CommandContext(ctx, cli, "tls", "k8s-secrets", dir).Output()
	if err != nil {
		t.Fatalf("curfew tls k8s-secrets: %v", err)
	}
	path := filepath.Join(t.TempDir(), "secrets.yaml")
	if err := os.WriteFile(path, secrets, 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Kubectl(ctx, "apply", "-f", path); err != nil {
		t.Fatal(err)
	}
	return dir
}

// portForward runs `kubectl port-forward RESOURCE :PORT` until the test ends and returns the
// local address.
func portForward(ctx context.Context, t *testing.T, c *cluster.Cluster, ns, target, port string) string {
	t.Helper()
	pctx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	cmd := exec.CommandContext(pctx, filepath.Join(os.Getenv(cluster.EnvNode), "kubectl"),
		"--kubeconfig="+c.Kubeconfig, "-n", ns, "port-forward", "--address=127.0.0.1", target, ":"+port)
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	var stderr strings.Builder
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cancel()
		_ = cmd.Wait()
	})
	// "Forwarding from 127.0.0.1:41234 -> 7700"
	re := regexp.MustCompile(`Forwarding from (127\.0\.0\.1:\d+) ->`)
	found := make(chan string, 1)
	go func() {
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			if m := re.FindStringSubmatch(sc.Text()); m != nil {
				found <- m[1]
			}
		}
	}()
	select {
	case addr := <-found:
		return addr
	case <-time.After(30 * time.Second):
		t.Fatalf("kubectl port-forward %s: no local address after 30s: %s", target, stderr.String())
		return ""
	}
}

// dialAPI connects to the orchestrator's API as curfew-cli over mTLS, checking the server's
// certificate for the name curfew-api, as a caller from outside the mesh does.
func dialAPI(t *testing.T, tlsDir, addr string) orchestratorv1.OrchestratorServiceClient {
	t.Helper()
	ca, err := os.ReadFile(filepath.Join(tlsDir, "ca.crt"))
	if err != nil {
		t.Fatal(err)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(ca) {
		t.Fatal("ca.crt: no certificate")
	}
	cert, err := tls.LoadX509KeyPair(filepath.Join(tlsDir, "curfew-cli.crt"), filepath.Join(tlsDir, "curfew-cli.key"))
	if err != nil {
		t.Fatal(err)
	}
	creds := credentials.NewTLS(&tls.Config{
		RootCAs:      pool,
		Certificates: []tls.Certificate{cert},
		ServerName:   "curfew-api",
		MinVersion:   tls.VersionTLS13,
	})
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(creds))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	return orchestratorv1.NewOrchestratorServiceClient(conn)
}

// waitTerminal polls GetRun until the run has ended.
func waitTerminal(ctx context.Context, t *testing.T, api orchestratorv1.OrchestratorServiceClient, runID string, within time.Duration) *orchestratorv1.Run {
	t.Helper()
	ctx, cancel := context.WithTimeout(ctx, within)
	defer cancel()
	for {
		res, err := api.GetRun(ctx, &orchestratorv1.GetRunRequest{RunId: runID})
		if err == nil && res.GetRun().GetStatus() != orchestratorv1.RunStatus_RUN_STATUS_RUNNING {
			return res.GetRun()
		}
		select {
		case <-ctx.Done():
			t.Fatalf("run %s not ended within %s (last: %v)", runID, within, err)
		case <-time.After(200 * time.Millisecond):
		}
	}
}

// treePlan is a plan with a model step, tools (one with a side effect) and a subagent
// with its own model steps and tool, ending in an answer. At 40 tokens/s, the subagent's
// subThink tokens keep its decoder running for subThink/40 seconds.
func treePlan(key string, subThink, sleepMS int) string {
	return fmt.Sprintf(`{"tokens_per_second": 40, "steps": [
	  {"think_tokens": 4, "tools": [
	    {"name": "sleep", "args": {"ms": %[3]d}},
	    {"name": "kv_put", "args": {"key": %[1]q, "value": 1}},
	    {"name": "spawn_subagent", "args": {"plan": {"tokens_per_second": 40, "steps": [
	      {"think_tokens": %[2]d, "tools": [{"name": "sleep", "args": {"ms": %[3]d}}]},
	      {"answer_tokens": 5}]}}}]},
	  {"answer_tokens": 5}]}`, key, subThink, sleepMS)
}

// testRunThroughTheService runs a plan through the curfew-api Service and one that a
// client disconnect cancels.
func testRunThroughTheService(ctx context.Context, t *testing.T, api orchestratorv1.OrchestratorServiceClient) {
	t.Run("a plan with subagents and tools succeeds", func(t *testing.T) {
		res, err := api.StartRun(ctx, &orchestratorv1.StartRunRequest{Task: treePlan("k8s-succeeds", 4, 200)})
		if err != nil {
			t.Fatal(err)
		}
		run := waitTerminal(ctx, t, api, res.GetRun().GetRunId(), 2*time.Minute)
		if run.GetStatus() != orchestratorv1.RunStatus_RUN_STATUS_SUCCEEDED {
			t.Fatalf("run %s: %s %s: %s", run.GetRunId(), run.GetStatus(), run.GetErrorCode(), run.GetErrorMessage())
		}
		kinds := map[meshv1.NodeKind]int{}
		for _, n := range run.GetNodes() {
			kinds[n.GetKind()]++
		}
		if kinds[meshv1.NodeKind_NODE_KIND_SUBAGENT] != 1 || kinds[meshv1.NodeKind_NODE_KIND_TOOL] < 3 || kinds[meshv1.NodeKind_NODE_KIND_MODEL] < 4 {
			t.Errorf("run %s: nodes by kind %v, want 1 subagent, ≥ 3 tools, ≥ 4 model steps", run.GetRunId(), kinds)
		}
	})

	t.Run("a client disconnect cancels every node", func(t *testing.T) {
		rctx, disconnect := context.WithCancel(ctx)
		defer disconnect()
		stream, err := api.Run(rctx, &orchestratorv1.RunRequest{Task: treePlan("k8s-disconnect", 4000, 60000)})
		if err != nil {
			t.Fatal(err)
		}
		// Disconnect once the subagent's decoder runs: the tree then has a running model
		// node at each level but the top one's (which has answered its first step),
		// tools and the subagent.
		var runID string
		var subagent bool
		for {
			ev, err := stream.Recv()
			if err != nil {
				t.Fatalf("before the disconnect: %v", err)
			}
			if s := ev.GetStarted(); s != nil {
				runID = s.GetRunId()
			}
			n := ev.GetNode()
			if n.GetStatus() != meshv1.NodeStatus_NODE_STATUS_RUNNING {
				continue
			}
			if n.GetKind() == meshv1.NodeKind_NODE_KIND_SUBAGENT {
				subagent = true
			}
			if subagent && n.GetKind() == meshv1.NodeKind_NODE_KIND_MODEL {
				break
			}
		}
		// A few tokens in, so that tokens after the cancel would show.
		time.Sleep(500 * time.Millisecond)
		disconnect()
		run := waitTerminal(ctx, t, api, runID, time.Minute)
		if run.GetStatus() != orchestratorv1.RunStatus_RUN_STATUS_CANCELLED {
			t.Errorf("run %s: %s, want CANCELLED", runID, run.GetStatus())
		}
		for _, n := range run.GetNodes() {
			if n.GetStatus() == meshv1.NodeStatus_NODE_STATUS_SUCCEEDED {
				continue // ended before the disconnect
			}
			if n.GetStatus() != meshv1.NodeStatus_NODE_STATUS_CANCELLED || n.GetCause() != meshv1.CancelCause_CANCEL_CAUSE_CLIENT_DISCONNECT {
				t.Errorf("node %s (%s %s): %s cause %s, want CANCELLED by CLIENT_DISCONNECT", n.GetId(), n.GetKind(), n.GetName(), n.GetStatus(), n.GetCause())
			}
			if n.GetKind() == meshv1.NodeKind_NODE_KIND_MODEL && n.GetTokensAfterCancel() > 1 {
				t.Errorf("model node %s: %d tokens after cancel, want ≤ 1", n.GetId(), n.GetTokensAfterCancel())
			}
		}
		t.Logf("run %s: %d nodes, %d tokens, %d after cancel", runID, len(run.GetNodes()), run.GetTokens(), run.GetTokensAfterCancel())
	})
}
