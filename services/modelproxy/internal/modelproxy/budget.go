package modelproxy

import (
	"context"
	"errors"
	"fmt"
	"slices"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	modelproxyv1 "github.com/curfew-mesh/curfew/gen/curfew/modelproxy/v1"
	"github.com/curfew-mesh/curfew/mesh/budget"
	"github.com/curfew-mesh/curfew/mesh/cancel"
	"github.com/curfew-mesh/curfew/services/modelproxy/internal/provider/sim"
)

// Budget reservation of a model call (docs/admission.md, "Per-call reservations").
const (
	// DefaultMaxTokens is the output bound reserved for a call without max_tokens when
	// its tenant has a budget; it is sent to the provider as the call's max_tokens, so
	// the bound holds.
	DefaultMaxTokens = 2048
	// messageOverhead is the tokens reserved per message on top of its bytes: the role
	// and the separators of the provider's chat template (OpenAI's is 3-4 per message).
	messageOverhead = 8
)

// reservation is what a call reserves against its tenant's budget: need tokens, bound
// the max_tokens to send the provider when the call named none (0: leave it), and detail
// the breakdown for a refusal's message.
//
// For sim the figures are exact: its prompt count (one per word, sim.PromptTokens) and
// its plan step's tokens (it ignores max_tokens). For a real provider the prompt is
// bounded by bytes: a BPE token covers at least one byte of UTF-8, so the bytes of the
// messages' (and notes') contents, tool calls and the tool specs, plus messageOverhead per message,
// are at least its prompt tokens; the output by max_tokens (DefaultMaxTokens when 0).
func reservation(rt route, req *modelproxyv1.GenerateRequest) (need int64, bound int32, detail string) {
	if d, ok := rt.(direct); ok {
		if out, ok := sim.StepTokens(d.req); ok {
			prompt := sim.PromptTokens(req.GetMessages())
			return prompt + int64(out), 0, fmt.Sprintf("prompt %d + the plan step's %d", prompt, out)
		}
	}
	var prompt int64
	// The notes (the time-left note) go to the provider after the messages: they count.
	for _, m := range append(slices.Clip(req.GetMessages()), req.GetNotes()...) {
		prompt += int64(len(m.GetContent())+len(m.GetToolCallId())) + messageOverhead
		for _, c := range m.GetToolCalls() {
			prompt += int64(len(c.GetId()) + len(c.GetName()) + len(c.GetArgsJson()))
		}
	}
	for _, t := range req.GetTools() {
		prompt += int64(len(t.GetName()) + len(t.GetDescription()) + len(t.GetParametersJson()))
	}
	if sc := req.GetResponseSchema(); sc != nil {
		prompt += int64(len(sc.GetSchemaJson()))
	}
	out := req.GetMaxTokens()
	if out <= 0 {
		out, bound = DefaultMaxTokens, DefaultMaxTokens
	}
	return prompt + int64(out), bound, fmt.Sprintf("prompt ≤ %d + max_tokens %d", prompt, out)
}

// reserve reserves the call's tokens against tenant's budget: budget.NoHold without
// budgets, a *budget.Refusal status when the budget cannot cover it.
func (s *Server) reserve(ctx context.Context, tenant string, rt route, req *modelproxyv1.GenerateRequest) (budget.Hold, int32, error) {
	if s.Budgets == nil {
		return budget.NoHold, 0, nil
	}
	need, bound, detail := reservation(rt, req)
	h, err := s.Budgets.Reserve(ctx, tenant, need)
	if err != nil {
		var rf *budget.Refusal
		if errors.As(err, &rf) {
			rf.Detail = detail
		}
		return nil, 0, err
	}
	return h, bound, nil
}

// cancelledRun is the status of a call refused because its run was cancelled before it
// arrived (nodes.Table.BeginLive): the cancel's cause, as a caller's cancel reads.
func cancelledRun(cause error) error {
	if errors.Is(cause, cancel.ErrDeadline) {
		return status.Error(codes.DeadlineExceeded, "run deadline exceeded: no model call starts after the run's cancel")
	}
	return status.Errorf(codes.Canceled, "cancelled: %v: no model call starts after the run's cancel", cause)
}
