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

// openAINode runs the SDK client in mode with key and plan, and decodes its JSON line.
func openAINode(ctx context.Context, t *testing.T, mode, key, plan string, into any) {
	t.Helper()
	cmd := exec.CommandContext(ctx, "node", openAINodeClient(t), mode)
	cmd.Env = append(os.Environ(), "CURFEW_OPENAI_URL="+openAIURL(t), "CURFEW_API_KEY="+key, "CURFEW_PLAN="+plan)
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

	var b struct {
		Error               string `json:"error"`
		Status              int    `json:"status"`
		AuthenticationError bool   `json:"authentication_error"`
	}
	openAINode(ctx, t, "badkey", key[:len(key)-4]+"AAAA", `{"steps": [{"answer_tokens": 1}]}`, &b)
	if !b.AuthenticationError || b.Status != 401 {
		t.Errorf("a bad key: %+v, want AuthenticationError (401)", b)
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
