package openaiapi

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"

	"google.golang.org/grpc"

	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
)

// recordingOrchestrator answers Run and WatchRun with a succeeded run's summary and
// StartRun with its id, recording what each call asked for.
type recordingOrchestrator struct {
	orchestratorv1.OrchestratorServiceClient
	mu           sync.Mutex
	run, watched orchestratorv1.RunEvents
}

// scripted is a stream that sends the started event and the summary, then io.EOF.
type scripted[T any] struct {
	grpc.ClientStream
	msgs []*T
}

func (e *scripted[T]) Recv() (*T, error) {
	if len(e.msgs) == 0 {
		return nil, io.EOF
	}
	m := e.msgs[0]
	e.msgs = e.msgs[1:]
	return m, nil
}

var summary = &orchestratorv1.Run{RunId: "r1", Status: orchestratorv1.RunStatus_RUN_STATUS_SUCCEEDED, Answer: "done"}

func (o *recordingOrchestrator) Run(_ context.Context, in *orchestratorv1.RunRequest, _ ...grpc.CallOption) (grpc.ServerStreamingClient[orchestratorv1.RunResponse], error) {
	o.mu.Lock()
	o.run = in.GetEvents()
	o.mu.Unlock()
	return &scripted[orchestratorv1.RunResponse]{msgs: []*orchestratorv1.RunResponse{
		{Event: &orchestratorv1.RunResponse_Started{Started: &orchestratorv1.RunStarted{RunId: "r1"}}},
		{Event: &orchestratorv1.RunResponse_Finished{Finished: summary}},
	}}, nil
}

func (o *recordingOrchestrator) StartRun(context.Context, *orchestratorv1.StartRunRequest, ...grpc.CallOption) (*orchestratorv1.StartRunResponse, error) {
	return &orchestratorv1.StartRunResponse{Run: &orchestratorv1.Run{RunId: "r1"}, Created: true}, nil
}

func (o *recordingOrchestrator) WatchRun(_ context.Context, in *orchestratorv1.WatchRunRequest, _ ...grpc.CallOption) (grpc.ServerStreamingClient[orchestratorv1.WatchRunResponse], error) {
	o.mu.Lock()
	o.watched = in.GetEvents()
	o.mu.Unlock()
	return &scripted[orchestratorv1.WatchRunResponse]{msgs: []*orchestratorv1.WatchRunResponse{
		{Event: &orchestratorv1.WatchRunResponse_Started{Started: &orchestratorv1.RunStarted{RunId: "r1"}}},
		{Event: &orchestratorv1.WatchRunResponse_Finished{Finished: summary}},
	}}, nil
}

// A completion that is not streamed reads only the run's summary, so it asks the
// orchestrator for nothing else, with an idempotency key (StartRun, then WatchRun) or
// without (Run); a streamed one asks for every event, the text it streams among them.
func TestCompletionsAskForTheEventsTheyRead(t *testing.T) {
	for _, c := range []struct {
		stream, keyed bool
		want          orchestratorv1.RunEvents
	}{
		{false, false, orchestratorv1.RunEvents_RUN_EVENTS_SUMMARY},
		{false, true, orchestratorv1.RunEvents_RUN_EVENTS_SUMMARY},
		{true, false, orchestratorv1.RunEvents_RUN_EVENTS_UNSPECIFIED},
		{true, true, orchestratorv1.RunEvents_RUN_EVENTS_UNSPECIFIED},
	} {
		o := &recordingOrchestrator{run: -1, watched: -1}
		h := New(Config{Orchestrator: o})
		body := `{"model": "sim", "messages": [{"role": "user", "content": "q"}], "stream": ` + map[bool]string{true: "true", false: "false"}[c.stream] + `}`
		r := httptest.NewRequest(http.MethodPost, "/v1/chat/completions", strings.NewReader(body))
		r.Header.Set("Authorization", "Bearer cfk_test")
		if c.keyed {
			r.Header.Set(IdempotencyKeyHeader, "k1")
		}
		w := httptest.NewRecorder()
		h.ServeHTTP(w, r)
		end := `"done"` // the answer, from the summary
		if c.stream {
			end = "[DONE]" // the stream's end (its text comes only from node events)
		}
		if w.Code != http.StatusOK || !strings.Contains(w.Body.String(), end) {
			t.Fatalf("stream %v, keyed %v: %d %s", c.stream, c.keyed, w.Code, w.Body)
		}
		got := o.run
		if c.keyed {
			got = o.watched
		}
		if got != c.want {
			t.Errorf("stream %v, keyed %v: asked for %v, want %v", c.stream, c.keyed, got, c.want)
		}
	}
}
