package orchestrator

import (
	"bytes"
	"context"
	"encoding/json"
	"log/slog"
	"strings"
	"sync"
	"testing"

	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
	"github.com/curfew-mesh/curfew/mesh"
)

type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

// records returns the JSON log records with message msg.
func (l *lockedBuffer) records(t *testing.T, msg string) []map[string]any {
	t.Helper()
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []map[string]any
	for line := range strings.Lines(l.b.String()) {
		var m map[string]any
		if err := json.Unmarshal([]byte(line), &m); err != nil {
			t.Fatalf("not JSON: %q", line)
		}
		if m["msg"] == msg {
			out = append(out, m)
		}
	}
	return out
}

// A run logs its start and its summary with run_id and figures; the task (the prompt)
// only with LogPrompts.
func TestRunLogs(t *testing.T) {
	for _, prompts := range []bool{false, true} {
		e := newEnv(t, mesh.ServerConfig{}, nil)
		var logs lockedBuffer
		e.srv.cfg.Log = slog.New(slog.NewJSONHandler(&logs, nil))
		e.srv.cfg.LogPrompts = prompts
		rs, started := e.start(context.Background(), t, &orchestratorv1.RunRequest{Task: tinyPlan})
		if _, err := rs.rest(); err != nil {
			t.Fatal(err)
		}
		r := e.waitEnded(t, started.GetRunId())
		e.srv.Wait()
		st, fin := logs.records(t, "run started"), logs.records(t, "run finished")
		if len(st) != 1 || len(fin) != 1 {
			t.Fatalf("prompts=%v: %d start and %d finish records, want 1 each", prompts, len(st), len(fin))
		}
		if st[0]["run_id"] != r.GetRunId() || st[0]["task_bytes"] != float64(len(tinyPlan)) || st[0]["model"] != "sim" {
			t.Errorf("start record %v", st[0])
		}
		if task, ok := st[0]["task"]; ok != prompts || (prompts && task != tinyPlan) {
			t.Errorf("prompts=%v: start record's task = %v", prompts, task)
		}
		if fin[0]["run_id"] != r.GetRunId() || fin[0]["status"] != "succeeded" || fin[0]["tokens"] != float64(r.GetTokens()) ||
			fin[0]["tokens_after_cancel"] != 0.0 || fin[0]["elapsed_ms"] == nil {
			t.Errorf("finish record %v", fin[0])
		}
	}
}
