package orchestrator

import (
	"context"
	"log/slog"

	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
)

// logStarted logs a run's admission. The task is the prompt, so it is logged only when
// Config.LogPrompts asks for it (--log-prompts); its size always is.
func (s *Server) logStarted(ctx context.Context, rn *run, model, task string) {
	if !s.cfg.Log.Enabled(ctx, slog.LevelInfo) {
		return
	}
	attrs := []slog.Attr{slog.String("run_id", rn.id), slog.String("node_id", RootNode), slog.String("model", model),
		slog.Time("deadline", rn.dl), slog.Int("task_bytes", len(task))}
	if s.cfg.LogPrompts {
		attrs = append(attrs, slog.String("task", task))
	}
	s.cfg.Log.LogAttrs(ctx, slog.LevelInfo, "run started", attrs...)
}

// logFinished logs a run's summary: its outcome, tokens, tokens after the cancel, and
// elapsed_ms from admission to the summary. Never the answer (model output).
func (s *Server) logFinished(ctx context.Context, r *orchestratorv1.Run) {
	lvl := slog.LevelInfo
	if r.GetTokensAfterCancel() > 0 {
		lvl = slog.LevelWarn // orphan tokens: the stop signal was late somewhere
	}
	if !s.cfg.Log.Enabled(ctx, lvl) {
		return
	}
	attrs := []slog.Attr{slog.String("run_id", r.GetRunId()), slog.String("node_id", RootNode),
		slog.String("status", lower(r.GetStatus().String(), "RUN_STATUS_")), slog.String("cause", lower(r.GetCause().String(), "CANCEL_CAUSE_"))}
	if r.GetErrorCode() != "" {
		attrs = append(attrs, slog.String("error_type", r.GetErrorCode()))
	}
	attrs = append(attrs, slog.Int("nodes", len(r.GetNodes())), slog.Int64("tokens", r.GetTokens()),
		slog.Int64("tokens_after_cancel", r.GetTokensAfterCancel()),
		slog.Int64("elapsed_ms", r.GetEndedAt().AsTime().Sub(r.GetCreatedAt().AsTime()).Milliseconds()))
	if r.GetCancelledAt() != nil {
		attrs = append(attrs, slog.Int64("cancel_ms", r.GetCancelledAt().AsTime().Sub(r.GetCreatedAt().AsTime()).Milliseconds()))
	}
	s.cfg.Log.LogAttrs(ctx, lvl, "run finished", attrs...)
}

func lower(s, prefix string) string {
	if len(s) >= len(prefix) && s[:len(prefix)] == prefix {
		s = s[len(prefix):]
	}
	b := []byte(s)
	for i, c := range b {
		if 'A' <= c && c <= 'Z' {
			b[i] = c + 'a' - 'A'
		}
	}
	return string(b)
}
