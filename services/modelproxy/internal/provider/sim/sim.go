package sim

import (
	"context"
	"io"
	"math/rand/v2"
	"strings"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	modelproxyv1 "github.com/curfew-mesh/curfew/gen/curfew/modelproxy/v1"
	"github.com/curfew-mesh/curfew/mesh/md"
	"github.com/curfew-mesh/curfew/mesh/plan"
	"github.com/curfew-mesh/curfew/services/modelproxy/internal/provider"
)

// Name is the sim model's name, and its provider's.
const Name = "sim"

// Provider is the sim model. The zero value is ready to use.
type Provider struct {
	// now is the clock of the token schedule; nil is time.Now.
	now func() time.Time
}

var (
	_ provider.Provider = (*Provider)(nil)
	_ provider.Checker  = (*Provider)(nil)
)

// New returns the sim model.
func New() *Provider { return &Provider{} }

// Name implements provider.Provider.
func (*Provider) Name() string { return Name }

// Check implements provider.Checker: it refuses, with INVALID_ARGUMENT, a conversation
// whose first user message is not a valid plan or whose assistant turns leave no step,
// and leaves the step in req.Checked.
func (*Provider) Check(req *provider.Request) error {
	st, err := pick(req.Messages)
	if err != nil {
		return err
	}
	req.Checked = st
	return nil
}

// Stream implements provider.Provider: it decodes the plan's step for this turn. The
// step's model_error fault fails the call's attempt (md.Identity.Attempt) before any
// token, unless ctx is WithoutModelError's.
func (p *Provider) Stream(ctx context.Context, req *provider.Request) (provider.Stream, error) {
	st, ok := req.Checked.(*step)
	if !ok {
		var err error
		if st, err = pick(req.Messages); err != nil {
			return nil, err
		}
	}
	attempt := max(md.IdentityFrom(ctx).Attempt, 1)
	if f := st.ModelError; f.Fails(attempt, rand.Float64) && !withoutModelError(ctx) {
		code := codes.Unavailable
		if f.Code != "" {
			code, _ = plan.ParseCode(f.Code)
		}
		return nil, &InjectedError{status.Newf(code, "sim model: injected error on attempt %d of %d", attempt, f.Attempts)}
	}
	now := p.now
	if now == nil {
		now = time.Now
	}
	n := st.ThinkTokens
	if st.AnswerTokens > 0 {
		n = st.AnswerTokens
	}
	return &stream{ctx: ctx, step: st, n: n, now: now, prompt: PromptTokens(req.Messages),
		interval: time.Duration(float64(time.Second) / st.plan.TPS()),
		start:    now().Add(time.Duration(st.FirstTokenDelayMS) * time.Millisecond)}, nil
}

// InjectedError is the error of an attempt failed by its step's model_error fault. It is
// the gRPC status the plan names (UNAVAILABLE by default).
type InjectedError struct{ s *status.Status }

func (e *InjectedError) Error() string { return e.s.Err().Error() }

// GRPCStatus is the error's status, for package status.
func (e *InjectedError) GRPCStatus() *status.Status { return e.s }

type withoutModelErrorKey struct{}

// WithoutModelError returns ctx under which the sim decodes a step as if its model_error
// fault did not fail the attempt: the decoder a provider would have left running after
// failing its caller.
func WithoutModelError(ctx context.Context) context.Context {
	return context.WithValue(ctx, withoutModelErrorKey{}, true)
}

func withoutModelError(ctx context.Context) bool {
	v, _ := ctx.Value(withoutModelErrorKey{}).(bool)
	return v
}

// step is the plan's step for this turn.
type step struct {
	plan  *plan.Plan
	index int
	plan.Step
}

// pick parses the plan from the conversation's first user message and picks the step
// from the number of assistant turns so far.
func pick(msgs []*modelproxyv1.Message) (*step, error) {
	var task string
	turns := 0
	for _, m := range msgs {
		switch m.GetRole() {
		case modelproxyv1.Role_ROLE_USER:
			if task == "" {
				task = m.GetContent()
			}
		case modelproxyv1.Role_ROLE_ASSISTANT:
			turns++
		}
	}
	if task == "" {
		return nil, status.Error(codes.InvalidArgument, "sim model: the conversation has no user message with a plan")
	}
	p, err := plan.Parse([]byte(task))
	if err != nil {
		return nil, status.Errorf(codes.InvalidArgument, "sim model: %v", err)
	}
	if turns >= len(p.Steps) {
		return nil, status.Errorf(codes.InvalidArgument, "sim model: the conversation has %d assistant turns but the plan has %d steps", turns, len(p.Steps))
	}
	return &step{plan: p, index: turns, Step: p.Steps[turns]}, nil
}

// StepTokens is the output tokens the step Check left in req.Checked will decode (its
// answer_tokens, else its think_tokens); ok is false when req was not checked by the sim
// model. The sim model ignores max_tokens, so this is the exact output of its call.
func StepTokens(req *provider.Request) (n int, ok bool) {
	st, ok := req.Checked.(*step)
	if !ok {
		return 0, false
	}
	if st.AnswerTokens > 0 {
		return st.AnswerTokens, true
	}
	return st.ThinkTokens, true
}

var words = []string{"the", "deadline", "reaches", "every", "leaf", "and", "the", "tree", "stops"}

// PromptTokens is the sim model's count of a request's prompt tokens: one per word
// (a run of non-space characters) of every message's content, the plan's message
// included, as each word of its output is one token. Tool calls and tool specs count
// none. It is the prompt_tokens of the usage on a step's final chunk.
func PromptTokens(msgs []*modelproxyv1.Message) int64 {
	var n int64
	for _, m := range msgs {
		n += int64(len(strings.Fields(m.GetContent())))
	}
	return n
}

// stream emits a step's tokens at the plan's rate, on an absolute schedule so that the
// rate does not drift, and then the final chunk.
type stream struct {
	ctx      context.Context
	step     *step
	n        int   // tokens to emit
	prompt   int64 // the request's prompt tokens (PromptTokens)
	i        int   // tokens emitted
	done     bool
	now      func() time.Time
	interval time.Duration
	start    time.Time
	timer    *time.Timer
}

// Recv returns the next token when it is due, the final chunk after the last token, then
// io.EOF; ctx's error once ctx is done.
func (s *stream) Recv() (*provider.Chunk, error) {
	if s.done {
		return nil, io.EOF
	}
	if s.i == s.n {
		s.done = true
		return s.final(), nil
	}
	due := s.start.Add(time.Duration(s.i+1) * s.interval)
	if wait := due.Sub(s.now()); wait > 0 {
		if s.timer == nil {
			s.timer = time.NewTimer(wait)
		} else {
			s.timer.Reset(wait)
		}
		select {
		case <-s.ctx.Done():
			return nil, s.ctx.Err()
		case <-s.timer.C:
		}
	}
	// Both may be ready at once and select picks at random: a cancelled decoder must not
	// emit the token it was waiting for.
	if err := s.ctx.Err(); err != nil {
		return nil, err
	}
	s.i++
	return &provider.Chunk{Delta: words[(s.i-1)%len(words)] + " ", Tokens: 1}, nil
}

// final is the step's last chunk: its usage, and its finish reason and tool calls.
func (s *stream) final() *provider.Chunk {
	st := s.step
	c := &provider.Chunk{Usage: &modelproxyv1.Usage{PromptTokens: s.prompt, CompletionTokens: int64(s.n)}}
	if st.AnswerTokens > 0 {
		c.FinishReason = "stop"
		return c
	}
	c.FinishReason = "tool_calls"
	for j, t := range st.Tools {
		args := string(t.Args)
		if args == "" {
			args = "{}"
		}
		c.ToolCalls = append(c.ToolCalls, &modelproxyv1.ToolCall{Id: plan.CallID(st.index, j), Name: t.Name, ArgsJson: args,
			IdempotencyKey: t.IdempotencyKey})
	}
	return c
}

// Close stops the stream's timer.
func (s *stream) Close() error {
	s.done = true
	if s.timer != nil {
		s.timer.Stop()
	}
	return nil
}
