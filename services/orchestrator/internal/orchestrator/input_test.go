package orchestrator

import (
	"context"
	"encoding/json"
	"fmt"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	modelproxyv1 "github.com/curfew-mesh/curfew/gen/curfew/modelproxy/v1"
	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
	"github.com/curfew-mesh/curfew/mesh"
	"github.com/curfew-mesh/curfew/mesh/agent"
	"github.com/curfew-mesh/curfew/mesh/md"
	"github.com/curfew-mesh/curfew/mesh/meshtest"
	"github.com/curfew-mesh/curfew/mesh/store"
)

func msg(role orchestratorv1.MessageRole, content string) *orchestratorv1.Message {
	return &orchestratorv1.Message{Role: role, Content: content}
}

const (
	system    = orchestratorv1.MessageRole_MESSAGE_ROLE_SYSTEM
	user      = orchestratorv1.MessageRole_MESSAGE_ROLE_USER
	assistant = orchestratorv1.MessageRole_MESSAGE_ROLE_ASSISTANT
	toolRole  = orchestratorv1.MessageRole_MESSAGE_ROLE_TOOL
)

// An invalid input is INVALID_ARGUMENT naming its field, on Run and StartRun alike, and
// starts nothing.
func TestRunInputValidation(t *testing.T) {
	e := newEnv(t, mesh.ServerConfig{}, nil)
	for _, tc := range []struct {
		name string
		req  *orchestratorv1.RunRequest
		want string
	}{
		{"no task nor user message", &orchestratorv1.RunRequest{Model: "gpt", Messages: []*orchestratorv1.Message{msg(system, "s")}},
			"task is required"},
		{"unspecified role", &orchestratorv1.RunRequest{Model: "gpt", Task: "t", Messages: []*orchestratorv1.Message{
			msg(system, "s"), msg(user, "u"), {Content: "x"}}}, "messages[2].role: must be system, user, assistant or tool"},
		{"system not first", &orchestratorv1.RunRequest{Model: "gpt", Task: "t", Messages: []*orchestratorv1.Message{
			msg(user, "u"), msg(system, "s")}}, "messages[1].role: a system message must be the first"},
		{"empty content", &orchestratorv1.RunRequest{Model: "gpt", Task: "t", Messages: []*orchestratorv1.Message{
			msg(assistant, " ")}}, "messages[0].content: required"},
		{"tool without call id", &orchestratorv1.RunRequest{Model: "gpt", Task: "t", Messages: []*orchestratorv1.Message{
			msg(toolRole, "{}")}}, "messages[0].tool_call_id: required"},
		{"tool naming no earlier call", &orchestratorv1.RunRequest{Model: "gpt", Task: "t", Messages: []*orchestratorv1.Message{
			msg(user, "u"), {Role: toolRole, Content: "{}", ToolCallId: "call_9"}, msg(assistant, "a"), msg(user, "u")}},
			`messages[1].tool_call_id: "call_9" names no tool call of an earlier assistant message`},
		{"tool before its call", &orchestratorv1.RunRequest{Model: "gpt", Task: "t", Messages: []*orchestratorv1.Message{
			msg(user, "u"), {Role: toolRole, Content: "{}", ToolCallId: "c1"},
			{Role: assistant, ToolCalls: []*orchestratorv1.ToolCall{{Id: "c1", Name: "sleep"}}}}},
			`messages[1].tool_call_id: "c1" names no tool call`},
		{"call without id", &orchestratorv1.RunRequest{Model: "gpt", Task: "t", Messages: []*orchestratorv1.Message{
			{Role: assistant, ToolCalls: []*orchestratorv1.ToolCall{{Name: "sleep"}}}}}, "messages[0].tool_calls[0].id: required"},
		{"call id twice", &orchestratorv1.RunRequest{Model: "gpt", Task: "t", Messages: []*orchestratorv1.Message{
			{Role: assistant, ToolCalls: []*orchestratorv1.ToolCall{{Id: "c1", Name: "sleep"}}},
			{Role: assistant, ToolCalls: []*orchestratorv1.ToolCall{{Id: "c1", Name: "sleep"}}}}},
			`messages[1].tool_calls[0].id: "c1" is the id of an earlier call`},
		{"call without name", &orchestratorv1.RunRequest{Model: "gpt", Task: "t", Messages: []*orchestratorv1.Message{
			{Role: assistant, ToolCalls: []*orchestratorv1.ToolCall{{Id: "c1"}}}}}, "messages[0].tool_calls[0].name: required"},
		{"call arguments not JSON", &orchestratorv1.RunRequest{Model: "gpt", Task: "t", Messages: []*orchestratorv1.Message{
			{Role: assistant, ToolCalls: []*orchestratorv1.ToolCall{{Id: "c1", Name: "sleep", ArgumentsJson: "{"}}}}},
			"messages[0].tool_calls[0].arguments_json: not JSON"},
		{"calls on a user message", &orchestratorv1.RunRequest{Model: "gpt", Task: "t", Messages: []*orchestratorv1.Message{
			{Role: user, Content: "u", ToolCalls: []*orchestratorv1.ToolCall{{Id: "c1", Name: "sleep"}}}}},
			"messages[0].tool_calls: only an assistant message has them"},
		{"sim with user messages", &orchestratorv1.RunRequest{Task: tinyPlan, Messages: []*orchestratorv1.Message{
			msg(user, "u")}}, "messages[0].role: the sim model takes its plan from task"},
		{"negative max_tokens", &orchestratorv1.RunRequest{Model: "gpt", Task: "t", MaxTokens: -1}, "max_tokens: must not be negative"},
		{"temperature above 2", &orchestratorv1.RunRequest{Model: "gpt", Task: "t", Temperature: proto.Float64(2.5)},
			"temperature: must be between 0 and 2"},
		{"negative temperature", &orchestratorv1.RunRequest{Model: "gpt", Task: "t", Temperature: proto.Float64(-0.1)},
			"temperature: must be between 0 and 2"},
		{"schema not JSON", &orchestratorv1.RunRequest{Model: "gpt", Task: "t", ResponseSchemaJson: "{"},
			"response_schema_json: not JSON"},
		{"schema not a schema", &orchestratorv1.RunRequest{Model: "gpt", Task: "t", ResponseSchemaJson: `{"type":"nonsense"}`},
			"response_schema_json: does not compile"},
		{"empty tool name", &orchestratorv1.RunRequest{Model: "gpt", Task: "t", Tools: []string{"sleep", ""}}, "tools[1]: empty tool name"},
		{"tool twice", &orchestratorv1.RunRequest{Model: "gpt", Task: "t", Tools: []string{"sleep", "sleep"}}, `tools[1]: "sleep" is listed twice`},
		{"max_steps above the service's", &orchestratorv1.RunRequest{Model: "gpt", Task: "t", MaxSteps: 65}, "max_steps: must be between 0"},
		{"unknown tool_errors", &orchestratorv1.RunRequest{Model: "gpt", Task: "t", ToolErrors: 7}, "tool_errors: unknown policy 7"},
		{"reserve not a duration", &orchestratorv1.RunRequest{Model: "gpt", Task: "t", Reserve: "soon"}, "reserve: must be a duration"},
		{"reserve fraction of 1", &orchestratorv1.RunRequest{Model: "gpt", Task: "t", Reserve: "1"}, "reserve: a fraction of the time left must be in (0, 1)"},
		{"reserve negative", &orchestratorv1.RunRequest{Model: "gpt", Task: "t", Reserve: "-2s"}, "reserve: a duration must be more than 0"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			st, err := e.orch.Run(context.Background(), tc.req)
			if err == nil {
				_, err = st.Recv()
			}
			meshtest.WantCode(t, err, codes.InvalidArgument, tc.want)
			sr := &orchestratorv1.StartRunRequest{Task: tc.req.GetTask(), Model: tc.req.GetModel(), Messages: tc.req.GetMessages(),
				MaxTokens: tc.req.GetMaxTokens(), Temperature: tc.req.Temperature, ResponseSchemaJson: tc.req.GetResponseSchemaJson(),
				Tools: tc.req.GetTools(), MaxSteps: tc.req.GetMaxSteps(), ToolErrors: tc.req.GetToolErrors(), Reserve: tc.req.GetReserve()}
			_, err = e.orch.StartRun(context.Background(), sr)
			meshtest.WantCode(t, err, codes.InvalidArgument, tc.want)
		})
	}
	resp, err := e.orch.ListRuns(context.Background(), &orchestratorv1.ListRunsRequest{})
	if err != nil || len(resp.GetRuns()) != 0 {
		t.Fatalf("ListRuns = %d runs, %v; want none started", len(resp.GetRuns()), err)
	}
}

// Every model step of a run gets its system prompt first, then the task, with its
// max_tokens, temperature and response schema; GetRun shows the input.
func TestRunInputReachesTheModel(t *testing.T) {
	e := newEnv(t, mesh.ServerConfig{}, nil)
	schema := `{"type":"string"}`
	rs, started := e.start(context.Background(), t, &orchestratorv1.RunRequest{Task: fastPlan,
		Messages: []*orchestratorv1.Message{msg(system, "you are terse")}, MaxTokens: 99, Temperature: proto.Float64(0),
		ResponseSchemaJson: schema})
	if _, err := rs.rest(); err != nil {
		t.Fatal(err)
	}
	reqs := e.model.requests()
	if len(reqs) < 2 {
		t.Fatalf("%d model requests, want every step's (at least 2)", len(reqs))
	}
	for i, req := range reqs {
		m := req.GetMessages()
		if len(m) < 2 || m[0].GetRole() != modelproxyv1.Role_ROLE_SYSTEM || m[0].GetContent() != "you are terse" ||
			m[1].GetRole() != modelproxyv1.Role_ROLE_USER || m[1].GetContent() != fastPlan {
			t.Errorf("request %d messages %v, want the system prompt, then the task", i, m)
		}
		if req.GetMaxTokens() != 99 || req.Temperature == nil || req.GetTemperature() != 0 || req.GetResponseSchema().GetSchemaJson() != schema {
			t.Errorf("request %d: max_tokens %d temperature %v schema %v", i, req.GetMaxTokens(), req.Temperature, req.GetResponseSchema())
		}
	}
	got := e.waitEnded(t, started.GetRunId())
	if got.GetStatus() != orchestratorv1.RunStatus_RUN_STATUS_SUCCEEDED || got.GetInput().GetMaxTokens() != 99 ||
		len(got.GetInput().GetMessages()) != 1 {
		t.Errorf("GetRun = %v %v, want succeeded with its input", got.GetStatus(), got.GetInput())
	}
}

// A StartRun idempotency key compares the whole input: the same request gets the same
// run; any field changed is ALREADY_EXISTS.
func TestStartRunKeyComparesInput(t *testing.T) {
	st := openStore(t)
	e := newDurableEnv(t, st, "orch-a", time.Second)
	ctx := metadata.AppendToOutgoingContext(context.Background(), md.Tenant, "acme")
	base := func() *orchestratorv1.StartRunRequest {
		return &orchestratorv1.StartRunRequest{Task: tinyPlan, IdempotencyKey: "k-in", Timeout: durationpb.New(10 * time.Second),
			Messages: []*orchestratorv1.Message{msg(system, "s")}, MaxTokens: 10, Temperature: proto.Float64(0.5),
			Tools: []string{"sleep"}, MaxSteps: 3, ToolErrors: orchestratorv1.ToolErrors_TOOL_ERRORS_FAIL_RUN}
	}
	first, err := e.orch.StartRun(ctx, base())
	if err != nil || !first.GetCreated() {
		t.Fatalf("first StartRun: %v", err)
	}
	again, err := e.orch.StartRun(ctx, base())
	if err != nil || again.GetCreated() || again.GetRun().GetRunId() != first.GetRun().GetRunId() {
		t.Fatalf("same request again: %v created=%v", err, again.GetCreated())
	}
	for i, change := range []func(*orchestratorv1.StartRunRequest){
		func(r *orchestratorv1.StartRunRequest) { r.Messages[0].Content = "other" },
		func(r *orchestratorv1.StartRunRequest) { r.MaxTokens = 11 },
		func(r *orchestratorv1.StartRunRequest) { r.Temperature = nil },
		func(r *orchestratorv1.StartRunRequest) { r.Temperature = proto.Float64(0) },
		func(r *orchestratorv1.StartRunRequest) { r.Tools = nil },
		func(r *orchestratorv1.StartRunRequest) { r.MaxSteps = 0 },
		func(r *orchestratorv1.StartRunRequest) { r.ToolErrors = orchestratorv1.ToolErrors_TOOL_ERRORS_TO_MODEL },
		func(r *orchestratorv1.StartRunRequest) { r.ResponseSchemaJson = `{"type":"string"}` },
		func(r *orchestratorv1.StartRunRequest) { r.Reserve = "2s" },
	} {
		r := base()
		change(r)
		_, err := e.orch.StartRun(ctx, r)
		t.Run(fmt.Sprint(i), func(t *testing.T) { meshtest.WantCode(t, err, codes.AlreadyExists, "another input") })
	}
	// The stored run carries its input: another server on the store serves it.
	got, err := st.GetRun(context.Background(), "acme", first.GetRun().GetRunId())
	if err != nil || !proto.Equal(decodeInput(got.Input), runInput(base().GetMessages(), 10, proto.Float64(0.5), "", []string{"sleep"}, 3,
		orchestratorv1.ToolErrors_TOOL_ERRORS_FAIL_RUN, "")) {
		t.Fatalf("stored input %v, %v", decodeInput(got.Input), err)
	}
}

// A dead owner's run is taken over with its stored input: the new owner's model steps get
// its system prompt and sampling options.
func TestTakeoverRunsWithTheStoredInput(t *testing.T) {
	st := openStore(t)
	ctx := context.Background()
	in := runInput([]*orchestratorv1.Message{msg(system, "stored prompt")}, 42, proto.Float64(1.5), "", nil, 0, 0, "0.25")
	run, _, err := st.CreateRun(ctx, store.NewRun{Tenant: "acme", Task: []byte(tinyPlan), Model: agent.DefaultModel,
		Input: encodeInput(in), Deadline: time.Now().Add(20 * time.Second), Owner: "dead", LeaseTTL: 50 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	e := newEnvWith(t, mesh.ServerConfig{}, nil, func(c *Config) {
		c.Store, c.Owner, c.LeaseTTL, c.DeadLetters = st, "orch-b", 200*time.Millisecond, deadLetters{st}
	})
	w, err := e.orch.WatchRun(metadata.AppendToOutgoingContext(ctx, md.Tenant, "acme"), &orchestratorv1.WatchRunRequest{RunId: run.RunID})
	if err != nil {
		t.Fatal(err)
	}
	evs, err := meshtest.Drain(w)
	if err != nil {
		t.Fatal(err)
	}
	if fin := evs[len(evs)-1].GetFinished(); fin.GetStatus() != orchestratorv1.RunStatus_RUN_STATUS_SUCCEEDED || fin.GetEpoch() != 2 ||
		!proto.Equal(fin.GetInput(), in) {
		t.Fatalf("resumed run ended %v at epoch %d with input %v", fin.GetStatus(), fin.GetEpoch(), fin.GetInput())
	}
	reqs := e.model.requests()
	if len(reqs) != 1 {
		t.Fatalf("%d model requests, want 1", len(reqs))
	}
	if m := reqs[0].GetMessages(); len(m) != 2 || m[0].GetContent() != "stored prompt" || reqs[0].GetMaxTokens() != 42 ||
		reqs[0].GetTemperature() != 1.5 {
		t.Errorf("the new owner's request: messages %v max_tokens %d temperature %v", m, reqs[0].GetMaxTokens(), reqs[0].Temperature)
	}
}

// A dead letter's payload carries the run's input, and replaying it starts a run with it.
func TestReplayKeepsTheInput(t *testing.T) {
	e := newEnv(t, mesh.ServerConfig{}, nil)
	in := runInput([]*orchestratorv1.Message{msg(system, "replayed prompt")}, 7, nil, "", []string{"sleep"}, 2,
		orchestratorv1.ToolErrors_TOOL_ERRORS_FAIL_RUN, "1s")
	var p ReplayPayload
	b, _ := json.Marshal(ReplayPayload{Task: tinyPlan, Input: encodeInput(in)})
	if err := json.Unmarshal(b, &p); err != nil || !proto.Equal(decodeInput(p.Input), in) {
		t.Fatalf("payload %s does not round-trip the input: %v", b, err)
	}
	ctx := md.WithIdentity(context.Background(), md.Identity{Tenant: md.DefaultTenant})
	id, created, err := e.srv.Replay(ctx, "replay-k", b, 10*time.Second)
	if err != nil || !created {
		t.Fatalf("Replay = %v created=%v", err, created)
	}
	if got := e.waitEnded(t, id); !proto.Equal(got.GetInput(), in) {
		t.Errorf("replayed run's input %v, want %v", got.GetInput(), in)
	}
	if reqs := e.model.requests(); len(reqs) == 0 || reqs[0].GetMessages()[0].GetContent() != "replayed prompt" || reqs[0].GetMaxTokens() != 7 {
		t.Errorf("the replayed run's model requests %v", reqs)
	}
}

// A prior tool turn (an assistant message's tool calls, then their tool messages) is
// valid, survives the store's encoding, and reaches the model as modelproxy's
// assistant tool calls and tool messages.
func TestPriorToolTurn(t *testing.T) {
	in := &orchestratorv1.RunInput{Messages: []*orchestratorv1.Message{
		msg(user, "wait 10 ms"),
		{Role: assistant, ToolCalls: []*orchestratorv1.ToolCall{{Id: "c1", Name: "sleep", ArgumentsJson: `{"ms": 10}`}, {Id: "c2", Name: "kv_get"}}},
		{Role: toolRole, Content: `{"slept_ms": 10}`, ToolCallId: "c1"},
		{Role: toolRole, Content: `{"value": null}`, ToolCallId: "c2"},
	}}
	if err := validateInput("and now?", "gpt", in, agent.DefaultMaxSteps); err != nil {
		t.Fatal(err)
	}
	back := decodeInput(encodeInput(in))
	if !proto.Equal(back, in) {
		t.Fatalf("stored input %v, want %v", back, in)
	}
	li := loopInput("gpt", "and now?", back)
	a := li.Messages[1]
	if a.GetRole() != modelproxyv1.Role_ROLE_ASSISTANT || len(a.GetToolCalls()) != 2 ||
		a.GetToolCalls()[0].GetId() != "c1" || a.GetToolCalls()[0].GetName() != "sleep" || a.GetToolCalls()[0].GetArgsJson() != `{"ms": 10}` ||
		a.GetToolCalls()[1].GetArgsJson() != "{}" {
		t.Errorf("the assistant turn reaches the model as %v", a)
	}
	if m := li.Messages[2]; m.GetRole() != modelproxyv1.Role_ROLE_TOOL || m.GetToolCallId() != "c1" || m.GetContent() != `{"slept_ms": 10}` {
		t.Errorf("the tool turn reaches the model as %v", m)
	}
}

// A CancelRun whose caller says its own client left (md.CancelCause) ends the run with
// cause client_disconnect; without the header the cause is operator.
func TestCancelRunClientLeft(t *testing.T) {
	e := newEnv(t, mesh.ServerConfig{}, nil)
	for _, c := range []struct {
		header []string
		want   meshv1.CancelCause
	}{
		{nil, meshv1.CancelCause_CANCEL_CAUSE_OPERATOR},
		{[]string{md.CancelCause, md.CancelCauseClientDisconnect}, meshv1.CancelCause_CANCEL_CAUSE_CLIENT_DISCONNECT},
	} {
		res, err := e.orch.StartRun(context.Background(), &orchestratorv1.StartRunRequest{Task: slowPlan, Timeout: durationpb.New(20 * time.Second)})
		if err != nil {
			t.Fatal(err)
		}
		ctx := metadata.AppendToOutgoingContext(context.Background(), c.header...)
		cr, err := e.orch.CancelRun(ctx, &orchestratorv1.CancelRunRequest{RunId: res.GetRun().GetRunId()})
		if err != nil {
			t.Fatal(err)
		}
		if r := cr.GetRun(); r.GetStatus() != orchestratorv1.RunStatus_RUN_STATUS_CANCELLED || r.GetCause() != c.want {
			t.Errorf("CancelRun with %v: %v cause %v, want CANCELLED %v", c.header, r.GetStatus(), r.GetCause(), c.want)
		}
	}
}
