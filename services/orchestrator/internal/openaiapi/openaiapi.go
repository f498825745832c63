package openaiapi

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"slices"
	"strings"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
)

// TimeoutHeader is the request header of a completion's time limit, a Go duration
// ("30s"); without it the orchestrator's default deadline applies, and either is capped
// at its maximum.
const TimeoutHeader = "X-Curfew-Timeout"

// ReserveHeader is the request header of the run's deadline reserve (docs/reserve.md): a
// duration ("2s") or a fraction of the time left ("0.2") its loop keeps for its final
// answer. The orchestrator checks it (INVALID_ARGUMENT naming reserve, so a 400).
const ReserveHeader = "X-Curfew-Reserve"

// maxBody bounds a request's body.
const maxBody = 4 << 20

// Config is a front door's configuration.
type Config struct {
	// Orchestrator is a client of the orchestrator's own gRPC listener (loopback), so
	// that every call passes its server chain. Required.
	Orchestrator orchestratorv1.OrchestratorServiceClient
	// Models, when set, returns the models GET /v1/models lists, for the request's API
	// key (modelproxy's ListModels, once the key is checked). Its error is a status
	// (UNAUTHENTICATED for a bad key).
	Models func(ctx context.Context, apiKey string) ([]Model, error)
	// DefaultModel is the orchestrator's default model (--model): listed first.
	DefaultModel string
	// Registered, when set, returns the names of the registered tools the tenant of the
	// request's API key may use (toolrunner's ListTools for that tenant): a request's
	// tools must be among them. Its error is a status (UNAUTHENTICATED for a bad key).
	// Nil: tools are passed to the run unchecked.
	Registered func(ctx context.Context, apiKey string) (map[string]bool, error)
	// DisconnectGrace is how long a keyed run whose clients all left waits for a retry
	// to attach before it is cancelled (IdempotencyKeyHeader); DefaultDisconnectGrace
	// when 0.
	DisconnectGrace time.Duration
	// Log receives the internal errors a client is not told of; nil: slog.Default().
	Log *slog.Logger
}

// Handler serves the OpenAI-compatible API.
type Handler struct {
	cfg   Config
	mux   *http.ServeMux
	keyed attached // the requests attached to each keyed run
}

// New returns the handler of cfg.
func New(cfg Config) *Handler {
	if cfg.Log == nil {
		cfg.Log = slog.Default()
	}
	if cfg.DisconnectGrace <= 0 {
		cfg.DisconnectGrace = DefaultDisconnectGrace
	}
	h := &Handler{cfg: cfg, mux: http.NewServeMux()}
	h.mux.HandleFunc("POST /v1/chat/completions", h.completions)
	h.mux.HandleFunc("GET /v1/models", h.models)
	h.mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		writeError(w, http.StatusNotFound, "invalid_request_error", "", "not_found", "no such endpoint: "+r.Method+" "+r.URL.Path)
	})
	return h
}

func (h *Handler) ServeHTTP(w http.ResponseWriter, r *http.Request) { h.mux.ServeHTTP(w, r) }

// apiError is OpenAI's error body.
type apiError struct {
	Error struct {
		Message string  `json:"message"`
		Type    string  `json:"type"`
		Param   *string `json:"param"`
		Code    *string `json:"code"`
	} `json:"error"`
}

func writeError(w http.ResponseWriter, httpStatus int, typ, param, code, msg string) {
	var e apiError
	e.Error.Message, e.Error.Type = msg, typ
	if param != "" {
		e.Error.Param = &param
	}
	if code != "" {
		e.Error.Code = &code
	}
	writeJSON(w, httpStatus, e)
}

func writeJSON(w http.ResponseWriter, httpStatus int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(httpStatus)
	_ = json.NewEncoder(w).Encode(v)
}

// badRequest is a request error naming its field.
type badRequest struct{ param, msg string }

func (e *badRequest) Error() string { return e.msg }

func invalid(param, format string, a ...any) error {
	return &badRequest{param: param, msg: fmt.Sprintf(format, a...)}
}

// authorize returns ctx carrying the request's bearer key as the call's API key, or
// false after answering 401. A request without a key never reaches the orchestrator:
// the loopback connection is a mesh peer, which the guard would let name a tenant.
func authorize(ctx context.Context, w http.ResponseWriter, r *http.Request) (context.Context, bool) {
	auth := r.Header.Get("Authorization")
	scheme, key, ok := strings.Cut(auth, " ")
	key = strings.TrimSpace(key)
	if !ok || !strings.EqualFold(scheme, "Bearer") || key == "" {
		w.Header().Set(ShouldRetryHeader, "false")
		writeError(w, http.StatusUnauthorized, "invalid_request_error", "", "invalid_api_key",
			"missing API key: send Authorization: Bearer <key> (curfew tenant create makes one)")
		return nil, false
	}
	return withKey(metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+key), key), true
}

type keyCtx struct{}

// withKey returns ctx carrying the request's API key, for Config.Registered.
func withKey(ctx context.Context, key string) context.Context {
	return context.WithValue(ctx, keyCtx{}, key)
}

// keyFrom returns the request's API key on ctx (authorize put it there).
func keyFrom(ctx context.Context) string {
	k, _ := ctx.Value(keyCtx{}).(string)
	return k
}

// deadline applies the request's TimeoutHeader to ctx, and returns it (0 for none).
func deadline(ctx context.Context, r *http.Request) (context.Context, context.CancelFunc, time.Duration, error) {
	v := r.Header.Get(TimeoutHeader)
	if v == "" {
		ctx, cancel := context.WithCancel(ctx)
		return ctx, cancel, 0, nil
	}
	d, err := time.ParseDuration(v)
	if err != nil || d <= 0 {
		return nil, nil, 0, invalid(TimeoutHeader, "header %s: %q is not a positive duration such as 30s", TimeoutHeader, v)
	}
	ctx, cancel := context.WithTimeout(ctx, d)
	return ctx, cancel, d, nil
}

// Model is one model GET /v1/models lists: a name a request's model may give.
type Model struct {
	// ID is the model's name: sim or an alias of modelproxy's providers file.
	ID string
	// OwnedBy is the provider of the alias's chain's first entry; "" is "curfew" (sim).
	OwnedBy string
}

func (h *Handler) models(w http.ResponseWriter, r *http.Request) {
	ctx, ok := authorize(r.Context(), w, r)
	if !ok {
		return
	}
	w = &answer{ResponseWriter: w}
	var models []Model
	if h.cfg.Models != nil {
		var err error
		if models, err = h.cfg.Models(ctx, keyFrom(ctx)); err != nil {
			h.writeStatus(w, err)
			return
		}
	}
	// The default model first, as OpenAI's clients often take the first.
	if i := slices.IndexFunc(models, func(m Model) bool { return m.ID == h.cfg.DefaultModel }); i > 0 {
		models = slices.Concat(models[i:i+1], models[:i], models[i+1:])
	}
	type model struct {
		ID      string `json:"id"`
		Object  string `json:"object"`
		Created int64  `json:"created"`
		OwnedBy string `json:"owned_by"`
	}
	list := struct {
		Object string  `json:"object"`
		Data   []model `json:"data"`
	}{Object: "list", Data: []model{}}
	for _, m := range models {
		owner := m.OwnedBy
		if owner == "" {
			owner = "curfew"
		}
		list.Data = append(list.Data, model{ID: m.ID, Object: "model", OwnedBy: owner})
	}
	writeJSON(w, http.StatusOK, list)
}

func (h *Handler) completions(w http.ResponseWriter, r *http.Request) {
	ctx, ok := authorize(r.Context(), w, r)
	if !ok {
		return
	}
	key := r.Header.Get(IdempotencyKeyHeader)
	w = &answer{ResponseWriter: w, keyed: key != ""}
	req, err := decodeRequest(io.LimitReader(r.Body, maxBody))
	var timeout time.Duration
	if err == nil {
		var cancel context.CancelFunc
		ctx, cancel, timeout, err = deadline(ctx, r)
		if err == nil {
			defer cancel()
		}
	}
	var run *orchestratorv1.RunRequest
	if err == nil {
		req.registered = h.cfg.Registered
		run, err = req.runRequest(ctx)
	}
	if err == nil {
		run.Reserve = r.Header.Get(ReserveHeader)
		if !req.Stream {
			run.Events = orchestratorv1.RunEvents_RUN_EVENTS_SUMMARY // complete reads the summary alone
		}
	}
	if err != nil {
		h.writeStatus(w, err)
		return
	}
	recv, done, err := h.open(ctx, run, key, timeout)
	// A client that left before the answer was written abandons a keyed run (open).
	defer func() { done(r.Context().Err() != nil) }()
	if err != nil {
		h.writeStatus(w, err)
		return
	}
	if req.Stream {
		h.stream(w, req, recv)
		return
	}
	h.complete(w, req, recv)
}

// complete answers a non-streamed completion once the run has ended. The Run call's
// context is the request's: a client that leaves cancels the run (one without an
// idempotency key: IdempotencyKeyHeader).
func (h *Handler) complete(w http.ResponseWriter, req *chatRequest, recv events) {
	var finished *orchestratorv1.Run
	for {
		ev, err := recv()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			if finished == nil || finished.GetStatus() != orchestratorv1.RunStatus_RUN_STATUS_SUCCEEDED {
				h.writeStatus(w, err)
				return
			}
			break
		}
		if f := ev.GetFinished(); f != nil {
			finished = f
		}
	}
	if finished == nil {
		h.writeStatus(w, status.Error(codes.Internal, "the run's stream ended without its summary"))
		return
	}
	if finished.GetStatus() != orchestratorv1.RunStatus_RUN_STATUS_SUCCEEDED {
		h.writeStatus(w, runStatus(finished))
		return
	}
	writeJSON(w, http.StatusOK, completion(finished, req.Model))
}

// runStatus is the status error of a run that did not succeed.
func runStatus(r *orchestratorv1.Run) error {
	var c codes.Code
	if err := c.UnmarshalJSON([]byte(`"` + r.GetErrorCode() + `"`)); err != nil || c == codes.OK {
		c = codes.Unknown
	}
	return status.Error(c, r.GetErrorMessage())
}

// answer is a completion's response writer: it knows whether the request has an
// idempotency key, which decides whether an SDK may retry a failure (writeStatus).
type answer struct {
	http.ResponseWriter
	keyed bool
}

// Flush flushes the stream's events.
func (a *answer) Flush() {
	if f, ok := a.ResponseWriter.(http.Flusher); ok {
		f.Flush()
	}
}
