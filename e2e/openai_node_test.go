package e2e

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
	"github.com/curfew-mesh/curfew/internal/meshproc"
)

// The OpenAI SDK tests drive the OpenAI-compatible API with the official openai npm
// package (examples/openai-node, pinned by its lock; scripts/node.sh openai installs it).
// Without Node.js they skip locally and fail under CI=true.

var (
	openAINodeOnce   sync.Once
	openAINodeScript string
	openAINodeErr    error
)

// openAINodeClient returns the path of examples/openai-node/client.mjs, installing its
// dependencies once.
func openAINodeClient(t *testing.T) string {
	t.Helper()
	openAINodeOnce.Do(func() {
		if _, err := exec.LookPath("node"); err != nil && os.Getenv("CI") != "true" {
			openAINodeErr = errors.New("skip: node is not installed")
			return
		}
		repo, err := meshproc.Repo()
		if err != nil {
			openAINodeErr = err
			return
		}
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
		defer cancel()
		cmd := exec.CommandContext(ctx, "bash", filepath.Join(repo, "scripts", "node.sh"), "openai")
		cmd.Dir = repo
		if out, err := cmd.CombinedOutput(); err != nil {
			openAINodeErr = fmt.Errorf("scripts/node.sh openai: %w\n%s", err, out)
			return
		}
		openAINodeScript = filepath.Join(repo, "examples", "openai-node", "client.mjs")
	})
	if openAINodeErr != nil {
		if strings.HasPrefix(openAINodeErr.Error(), "skip: ") && os.Getenv("CI") != "true" {
			t.Skip(openAINodeErr.Error()[len("skip: "):])
		}
		t.Fatal(openAINodeErr)
	}
	return openAINodeScript
}

// openAINode runs the SDK client in mode with key and plan (and env, more of its
// environment), and decodes its JSON line.
func openAINode(ctx context.Context, t *testing.T, mode, key, plan string, into any, env ...string) {
	t.Helper()
	cmd := exec.CommandContext(ctx, "node", openAINodeClient(t), mode)
	cmd.Env = append(append(os.Environ(), "CURFEW_OPENAI_URL="+openAIURL(t), "CURFEW_API_KEY="+key, "CURFEW_PLAN="+plan), env...)
	out, err := cmd.Output()
	if err != nil {
		var ee *exec.ExitError
		if errors.As(err, &ee) {
			t.Fatalf("node client.mjs %s: %v\n%s", mode, err, ee.Stderr)
		}
		t.Fatalf("node client.mjs %s: %v", mode, err)
	}
	if err := json.Unmarshal(out, into); err != nil {
		t.Fatalf("node client.mjs %s printed %s: %v", mode, out, err)
	}
}

type sdkUsage struct {
	CompletionTokens int64 `json:"completion_tokens"`
	TotalTokens      int64 `json:"total_tokens"`
}

// The official openai SDK: a completion answers, a stream arrives as deltas with usage
// at its end, a bad key raises AuthenticationError, and aborting a stream cancels the run.
func TestOpenAINodeSDK(t *testing.T) {
	t.Parallel()
	openAINodeClient(t)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	key := tenantKey(ctx, t, "openai-sdk-"+uuid.NewString()[:8], false)
	ext := newExternal(t, key)

	var c struct {
		ID           string   `json:"id"`
		Content      string   `json:"content"`
		FinishReason string   `json:"finish_reason"`
		Usage        sdkUsage `json:"usage"`
	}
	openAINode(ctx, t, "complete", key, `{"tokens_per_second": 500, "steps": [{"answer_tokens": 5}]}`, &c)
	run, err := ext.orch.GetRun(ctx, &orchestratorv1.GetRunRequest{RunId: c.ID})
	if err != nil || c.Content == "" || c.Content != run.GetRun().GetAnswer() || c.FinishReason != "stop" || c.Usage.CompletionTokens < 5 {
		t.Errorf("complete: %+v; the run %v (%v)", c, run.GetRun(), err)
	}

	var s struct {
		ID        string    `json:"id"`
		Content   string    `json:"content"`
		Deltas    int       `json:"deltas"`
		Usage     *sdkUsage `json:"usage"`
		UsageLast bool      `json:"usage_last"`
	}
	openAINode(ctx, t, "stream", key, `{"tokens_per_second": 200, "steps": [{"answer_tokens": 20}]}`, &s)
	run, err = ext.orch.GetRun(ctx, &orchestratorv1.GetRunRequest{RunId: s.ID})
	if err != nil || s.Deltas < 2 || s.Content != run.GetRun().GetAnswer() || s.Usage == nil || s.Usage.CompletionTokens < 20 || !s.UsageLast {
		t.Errorf("stream: %+v; the run %v (%v); want several deltas of the answer, then usage last", s, run.GetRun(), err)
	}

	// A missing key and a bad one: AuthenticationError (401), from OpenAI's error shape
	// (the SDK reads type and code from the body's error object).
	for _, c := range []struct{ mode, key string }{{"nokey", ""}, {"badkey", key[:len(key)-4] + "AAAA"}} {
		var b struct {
			Error               string `json:"error"`
			Status              int    `json:"status"`
			AuthenticationError bool   `json:"authentication_error"`
			Type                string `json:"type"`
			Code                string `json:"code"`
		}
		openAINode(ctx, t, c.mode, c.key, `{"steps": [{"answer_tokens": 1}]}`, &b)
		if !b.AuthenticationError || b.Status != 401 || b.Type == "" || b.Code == "" {
			t.Errorf("%s: %+v, want AuthenticationError (401) with the error's type and code", c.mode, b)
		}
	}

	var a struct {
		ID      string `json:"id"`
		Aborted bool   `json:"aborted"`
	}
	openAINode(ctx, t, "abort", key, `{"tokens_per_second": 50, "steps": [{"think_tokens": 100000}, {"answer_tokens": 1}]}`, &a)
	if a.ID == "" || !a.Aborted {
		t.Fatalf("abort: %+v, want the run id and an aborted signal", a)
	}
	var got *orchestratorv1.Run
	for deadline := time.Now().Add(30 * time.Second); time.Now().Before(deadline); time.Sleep(100 * time.Millisecond) {
		r, err := ext.orch.GetRun(ctx, &orchestratorv1.GetRunRequest{RunId: a.ID})
		if err != nil {
			t.Fatal(err)
		}
		if got = r.GetRun(); got.GetStatus() != orchestratorv1.RunStatus_RUN_STATUS_RUNNING {
			break
		}
	}
	if got.GetStatus() != orchestratorv1.RunStatus_RUN_STATUS_CANCELLED || got.GetCause() != meshv1.CancelCause_CANCEL_CAUSE_CLIENT_DISCONNECT {
		t.Errorf("the aborted stream's run: %v cause %v, want CANCELLED, client_disconnect", got.GetStatus(), got.GetCause())
	}
}

// checkClientCancelled fails unless run r ended CANCELLED client_disconnect with every
// node that had not ended by then cancelled client_disconnect, and its decoders stopped
// (checkFrozen: at most 1 token after the cancel each, one at least live at it).
func checkClientCancelled(t *testing.T, what string, r *orchestratorv1.Run) {
	t.Helper()
	if r.GetStatus() != orchestratorv1.RunStatus_RUN_STATUS_CANCELLED || r.GetCause() != meshv1.CancelCause_CANCEL_CAUSE_CLIENT_DISCONNECT {
		t.Errorf("%s: the run %v cause %v, want CANCELLED, client_disconnect\n%s", what, r.GetStatus(), r.GetCause(), dump(r))
		return
	}
	for _, n := range r.GetNodes() {
		if n.GetStatus() != meshv1.NodeStatus_NODE_STATUS_SUCCEEDED &&
			(n.GetStatus() != meshv1.NodeStatus_NODE_STATUS_CANCELLED || n.GetCause() != meshv1.CancelCause_CANCEL_CAUSE_CLIENT_DISCONNECT) {
			t.Errorf("%s: node %s %v cause %v, want CANCELLED client_disconnect\n%s", what, n.GetId(), n.GetStatus(), n.GetCause(), dump(r))
		}
	}
	checkFrozen(t, r)
}

// The official openai SDK's AbortController, on a streamed and on a non-streamed
// completion whose tree has three decoders at work, cancels the whole tree: every node
// still running ends client_disconnect, each decoder at most 1 token after the cancel.
func TestOpenAINodeSDKAbortCancelsTheTree(t *testing.T) {
	t.Parallel()
	openAINodeClient(t)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	for _, mode := range []string{"abort", "abort-complete"} {
		// A tenant per mode, whose one run is the request's.
		key := tenantKey(ctx, t, "openai-sdk-ab-"+uuid.NewString()[:8], false)
		ext := newExternal(t, key)
		var a struct {
			ID       string `json:"id"`
			Aborted  bool   `json:"aborted"`
			Answered bool   `json:"answered"`
		}
		// nodeRunNodes has three decoders at work 1.5 s in, for 10 s.
		openAINode(ctx, t, mode, key, nodeRunNodes, &a, "CURFEW_ABORT_AFTER_MS=2000")
		if !a.Aborted || a.Answered {
			t.Fatalf("%s: %+v, want the request aborted before its answer", mode, a)
		}
		l, err := ext.orch.ListRuns(ctx, &orchestratorv1.ListRunsRequest{})
		if err != nil || len(l.GetRuns()) != 1 {
			t.Fatalf("%s: runs %v (%v), want the request's one", mode, l.GetRuns(), err)
		}
		if a.ID != "" && a.ID != l.GetRuns()[0].GetRunId() {
			t.Errorf("%s: the stream's id %s, want its run's %s", mode, a.ID, l.GetRuns()[0].GetRunId())
		}
		checkClientCancelled(t, mode, summary(ctx, t, ext.orch, l.GetRuns()[0].GetRunId()))
	}
}

// With the official openai SDK, a request with an Idempotency-Key that the client
// aborts (its connection broke) and sends again with the same key attaches to the same
// run: one run, whose answer the retry gets.
func TestOpenAINodeSDKRetryWithKeyAttaches(t *testing.T) {
	t.Parallel()
	openAINodeClient(t)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	key := tenantKey(ctx, t, "openai-sdk-idem-"+uuid.NewString()[:8], false)
	ext := newExternal(t, key)
	var r struct {
		FirstAnswered bool   `json:"first_answered"`
		ID            string `json:"id"`
		Content       string `json:"content"`
	}
	openAINode(ctx, t, "retry-key", key, `{"tokens_per_second": 40, "steps": [{"think_tokens": 60}, {"answer_tokens": 8}]}`, &r,
		"CURFEW_ABORT_AFTER_MS=500", "CURFEW_IDEMPOTENCY_KEY=idem-"+uuid.NewString())
	if r.FirstAnswered || r.Content == "" {
		t.Fatalf("retry-key: %+v, want the first try aborted and the retry answered", r)
	}
	l, err := ext.orch.ListRuns(ctx, &orchestratorv1.ListRunsRequest{})
	if err != nil || len(l.GetRuns()) != 1 || l.GetRuns()[0].GetRunId() != r.ID {
		t.Fatalf("runs %v (%v), want one, the retry's %s", l.GetRuns(), err, r.ID)
	}
	if got := summary(ctx, t, ext.orch, r.ID); got.GetStatus() != orchestratorv1.RunStatus_RUN_STATUS_SUCCEEDED || got.GetAnswer() != r.Content {
		t.Errorf("the run: %v %q, want SUCCEEDED with the retry's answer %q", got.GetStatus(), got.GetAnswer(), r.Content)
	}
}
