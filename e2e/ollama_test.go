package e2e

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	modelproxyv1 "github.com/curfew-mesh/curfew/gen/curfew/modelproxy/v1"
	"github.com/curfew-mesh/curfew/internal/meshproc"
	"github.com/curfew-mesh/curfew/internal/ollamatest"
	"github.com/curfew-mesh/curfew/mesh/meshtls"
)

// TestModelProxyRealInferenceServer: modelproxy streams completions through its OpenAI
// provider from a real OpenAI-compatible server, ollama v0.6.8 on loopback serving a tiny
// random-weight llama model (internal/ollamatest), and a caller's cancel mid-stream stops
// the server's decoding.
//
// It runs its own mesh, whose modelproxy reads a providers file naming the ollama server
// (CURFEW_PROVIDERS_CONFIG), and calls modelproxy's Generate directly, as the agent loop
// does. Bounds, from the server's side (ollamatest's constants): after the cancel the
// server's access log shows the request finished within 2 s (measured: milliseconds), and
// its runner's CPU time grows by at most 20 ms over the 2 s after that, where decoding
// burns about a CPU-second per second. modelproxy's ledger shows at most 1 token after the
// cancel instant.
//
// Not parallel: it times a decoder on a 2-core machine, so it runs before the package's
// parallel tests are released.
func TestModelProxyRealInferenceServer(t *testing.T) {
	srv := ollamatest.Start(t, ollamatest.Options{})

	cfg := filepath.Join(t.TempDir(), "providers.json")
	b, err := json.Marshal(map[string]any{
		"providers": []map[string]any{{
			"name": "ollama", "base_url": srv.BaseURL, "api_key_env": "", "timeout": "60s",
			"models": []string{srv.Model},
		}},
		"models": map[string]any{"tiny": map[string]any{"chain": []string{"ollama/" + srv.Model}}},
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(cfg, b, 0o600); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	m, err := meshproc.Start(ctx, t.TempDir(), meshproc.Options{Env: []string{"CURFEW_PROVIDERS_CONFIG=" + cfg}})
	if err != nil {
		t.Fatalf("start a mesh with the ollama provider: %v", err)
	}
	t.Cleanup(func() {
		if err := m.Stop(); err != nil {
			t.Errorf("curfew up did not stop cleanly: %v", err)
		}
	})
	conn, err := m.ConnAs(meshtls.Orchestrator, "modelproxy") // as a caller of Generate
	if err != nil {
		t.Fatal(err)
	}
	mp := modelproxyv1.NewModelProxyServiceClient(conn)
	report, err := m.Report("modelproxy")
	if err != nil {
		t.Fatal(err)
	}

	// generate calls Generate as node root/m0 of a fresh run and reads the stream, calling
	// onChunk for each chunk, until it ends.
	generate := func(ctx context.Context, run, model string, maxTokens int32, onChunk func(*modelproxyv1.GenerateResponse)) error {
		ctx = metadata.AppendToOutgoingContext(ctx, "curfew-run-id", run, "curfew-node-id", "root/m0",
			"curfew-retry-id", "rid-"+run, "curfew-attempt", "1")
		st, err := mp.Generate(ctx, &modelproxyv1.GenerateRequest{Model: model, MaxTokens: maxTokens,
			Messages: []*modelproxyv1.Message{{Role: modelproxyv1.Role_ROLE_USER, Content: "Tell me a long story about the night bell."}}})
		if err != nil {
			return err
		}
		for {
			resp, err := st.Recv()
			if errors.Is(err, io.EOF) {
				return nil
			}
			if err != nil {
				return err
			}
			if ctx.Err() != nil {
				// Cancelled: a chunk still buffered here left modelproxy before the cancel
				// (the ledger below counts spend); a cancelled caller reads nothing more.
				return status.FromContextError(ctx.Err()).Err()
			}
			onChunk(resp)
		}
	}
	node := func(t *testing.T, run string, cancelAt time.Time) *meshv1.Node {
		t.Helper()
		req := &meshv1.ListNodesRequest{RunId: run, SettleTimeout: durationpb.New(5 * time.Second)}
		if !cancelAt.IsZero() {
			req.CancelAt = timestamppb.New(cancelAt)
		}
		resp, err := report.ListNodes(ctx, req)
		if err != nil {
			t.Fatal(err)
		}
		if !resp.GetSettled() || len(resp.GetNodes()) != 1 {
			t.Fatalf("modelproxy's nodes of run %s: settled %v, %v", run, resp.GetSettled(), resp.GetNodes())
		}
		return resp.GetNodes()[0]
	}

	// A whole completion, by alias and by provider/model: tokens arrive, and the last chunk
	// names the provider that answered.
	for _, model := range []string{"tiny", "ollama/" + srv.Model} {
		t.Run("stream "+model, func(t *testing.T) {
			const maxTokens = 200
			run := fmt.Sprintf("e2e-ollama-stream-%d", time.Now().UnixNano())
			sent := time.Now()
			var tokens int32
			var last *modelproxyv1.GenerateResponse
			err := generate(ctx, run, model, maxTokens, func(r *modelproxyv1.GenerateResponse) {
				tokens += r.GetTokens()
				last = r
			})
			if err != nil {
				t.Fatalf("Generate %s: %v", model, err)
			}
			if tokens < maxTokens*9/10 || tokens > maxTokens {
				t.Errorf("%d tokens streamed, want about %d (max_tokens)", tokens, maxTokens)
			}
			if last.GetProvider() != "ollama" || last.GetServedModel() != srv.Model || last.GetCached() {
				t.Errorf("last chunk: provider %q model %q cached %v, want ollama %s, not cached",
					last.GetProvider(), last.GetServedModel(), last.GetCached(), srv.Model)
			}
			if u := last.GetUsage().GetCompletionTokens(); u != int64(tokens) {
				t.Errorf("usage.completion_tokens %d, streamed %d", u, tokens)
			}
			r, err := srv.WaitRequest(ctx, "POST /v1/chat/completions", sent)
			if err != nil || r.Status != 200 {
				t.Errorf("the server's record of the request: %+v, %v", r, err)
			}
			n := node(t, run, time.Time{})
			if n.GetProvider() != "ollama" || n.GetTokens() != int64(tokens) || n.GetStatus() != meshv1.NodeStatus_NODE_STATUS_SUCCEEDED {
				t.Errorf("modelproxy's node: provider %q, %d tokens, %s; want ollama, %d, SUCCEEDED", n.GetProvider(), n.GetTokens(), n.GetStatus(), tokens)
			}
			t.Logf("%s: %d tokens in %v through modelproxy from ollama", model, tokens, time.Since(sent).Round(time.Millisecond))
		})
	}

	// Cancelled mid-stream: the server's request ends within the bound and its decoder stops;
	// modelproxy's ledger shows at most one token after the cancel.
	t.Run("cancel", func(t *testing.T) {
		run := fmt.Sprintf("e2e-ollama-cancel-%d", time.Now().UnixNano())
		res := ollamatest.CancelMidStream(ctx, t, srv, func(ctx context.Context, onToken func()) error {
			return generate(ctx, run, "tiny", 0, func(r *modelproxyv1.GenerateResponse) {
				for range r.GetTokens() {
					onToken()
				}
			})
		})
		res.Check(t)
		if status.Code(res.CallErr) != codes.Canceled {
			t.Errorf("the cancelled call ended with %v, want CANCELLED", res.CallErr)
		}
		n := node(t, run, res.CancelledAt)
		t.Logf("modelproxy's ledger: %d tokens, %d at the cancel, %d after; node %s cause %s provider %q",
			n.GetTokens(), n.GetTokensAtCancel(), n.GetTokensAfterCancel(), n.GetStatus(), n.GetCause(), n.GetProvider())
		if n.GetTokensAfterCancel() > 1 {
			t.Errorf("modelproxy's ledger shows %d tokens after the cancel, at most 1 allowed", n.GetTokensAfterCancel())
		}
		if n.GetTokensAtCancel() < int64(res.TokensBeforeCancel) {
			t.Errorf("the ledger shows %d tokens at the cancel, the caller had received %d", n.GetTokensAtCancel(), res.TokensBeforeCancel)
		}
		if n.GetStatus() != meshv1.NodeStatus_NODE_STATUS_CANCELLED {
			t.Errorf("modelproxy's node ended %s, want CANCELLED", n.GetStatus())
		}
	})
}
