package openaiapi

import (
	"encoding/json"
	"errors"
	"io"
	"net/http"

	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
	"github.com/curfew-mesh/curfew/mesh/agent"
)

// chunk is OpenAI's chat.completion.chunk.
type chunk struct {
	ID      string        `json:"id"`
	Object  string        `json:"object"`
	Created int64         `json:"created"`
	Model   string        `json:"model"`
	Choices []chunkChoice `json:"choices"`
	Usage   *usage        `json:"usage,omitempty"`
}

type chunkChoice struct {
	Index        int     `json:"index"`
	Delta        delta   `json:"delta"`
	FinishReason *string `json:"finish_reason"`
}

type delta struct {
	Role    string `json:"role,omitempty"`
	Content string `json:"content,omitempty"`
}

// stream answers a streamed completion: server-sent chat.completion.chunks of the text
// deltas of the run's own model steps (nodes root/m<i>, see
// rootModel), then a chunk with finish_reason, a usage chunk when asked, and [DONE]. An
// error before the first chunk is an HTTP error; after it, an SSE error event.
func (h *Handler) stream(w http.ResponseWriter, req *chatRequest, recv events) {
	first, err := recv()
	if err != nil {
		h.writeStatus(w, err)
		return
	}
	started := first.GetStarted()
	id := started.GetRunId()
	model := req.Model
	flusher, _ := w.(http.Flusher)
	w.Header().Set("Content-Type", "text/event-stream")
	w.Header().Set("Cache-Control", "no-cache")
	w.WriteHeader(http.StatusOK)
	send := func(v any) bool {
		b, _ := json.Marshal(v)
		if _, err := w.Write(append(append([]byte("data: "), b...), '\n', '\n')); err != nil {
			return false
		}
		if flusher != nil {
			flusher.Flush()
		}
		return true
	}
	base := chunk{ID: id, Object: "chat.completion.chunk", Model: model}
	c := base
	c.Choices = []chunkChoice{{Delta: delta{Role: "assistant"}}}
	if !send(c) {
		return
	}
	var finished *orchestratorv1.Run
	for {
		ev, err := recv()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			if finished != nil && finished.GetStatus() == orchestratorv1.RunStatus_RUN_STATUS_SUCCEEDED {
				break
			}
			h.streamError(w, flusher, err)
			return
		}
		if f := ev.GetFinished(); f != nil {
			finished = f
			continue
		}
		ne := ev.GetNodeEvent()
		if t := ne.GetText(); t != nil && agent.IsModelStepOf("root", ne.GetNodeId()) {
			c := base
			c.Choices = []chunkChoice{{Delta: delta{Content: t.GetText()}}}
			if !send(c) {
				return
			}
		}
	}
	if finished == nil {
		return
	}
	stop := "stop"
	c = base
	c.Model = modelOf(finished, model)
	c.Choices = []chunkChoice{{Delta: delta{}, FinishReason: &stop}}
	if !send(c) {
		return
	}
	if req.StreamOptions != nil && req.StreamOptions.IncludeUsage {
		c := base
		c.Model = modelOf(finished, model)
		c.Choices = []chunkChoice{}
		c.Usage = usageOf(finished)
		if !send(c) {
			return
		}
	}
	_, _ = io.WriteString(w, "data: [DONE]\n\n")
	if flusher != nil {
		flusher.Flush()
	}
}

// streamError ends a stream whose headers are sent with an error event in OpenAI's
// error shape, which the SDKs raise as an APIError.
func (h *Handler) streamError(w http.ResponseWriter, flusher http.Flusher, err error) {
	rec := &recorder{header: http.Header{}}
	h.writeStatus(rec, err)
	_, _ = io.WriteString(w, "data: ")
	_, _ = w.Write(rec.body)
	_, _ = io.WriteString(w, "\n")
	if flusher != nil {
		flusher.Flush()
	}
}

// recorder captures an error body to send as an SSE event.
type recorder struct {
	header http.Header
	body   []byte
}

func (r *recorder) Header() http.Header         { return r.header }
func (r *recorder) Write(b []byte) (int, error) { r.body = append(r.body, b...); return len(b), nil }
func (r *recorder) WriteHeader(int)             {}
