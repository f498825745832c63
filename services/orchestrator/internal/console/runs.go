package console

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strings"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"

	adminv1 "github.com/curfew-mesh/curfew/gen/curfew/admin/v1"
	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
	"github.com/curfew-mesh/curfew/mesh/store"
)

// listPage is how many runs a page of the list shows.
const listPage = 50

// timeForm is the filters' time format, the browser's datetime-local input, in UTC.
const timeForm = "2006-01-02T15:04"

// runFilter is the run list's query string.
type runFilter struct {
	Status, Tenant, Model, From, To, After string
}

func (f runFilter) query(after string) string {
	v := url.Values{}
	for k, s := range map[string]string{"status": f.Status, "tenant": f.Tenant, "model": f.Model, "from": f.From, "to": f.To, "after": after} {
		if s != "" {
			v.Set(k, s)
		}
	}
	return v.Encode()
}

// runList shows a page of runs, newest first: the user's tenant's, or an operator's
// choice of tenant (every one by default). ?fragment=1 answers the rows alone, for the
// page's refresh.
func (h *Handler) runList(w http.ResponseWriter, r *http.Request, u *user) {
	q := r.URL.Query()
	f := runFilter{Status: q.Get("status"), Tenant: strings.TrimSpace(q.Get("tenant")), Model: strings.TrimSpace(q.Get("model")),
		From: q.Get("from"), To: q.Get("to"), After: q.Get("after")}
	sq := store.RunQuery{Status: store.RunStatus(f.Status), Model: f.Model, After: f.After, Limit: listPage}
	switch {
	case !u.Operator():
		sq.Tenant, f.Tenant = u.Tenant(), ""
	case f.Tenant != "":
		sq.Tenant = f.Tenant
	default:
		sq.AllTenants = true
	}
	var bad []string
	if f.Status != "" && !sq.Status.Known() {
		bad = append(bad, fmt.Sprintf("unknown status %q", f.Status))
	}
	for _, t := range []struct {
		v   string
		out *time.Time
	}{{f.From, &sq.CreatedAfter}, {f.To, &sq.CreatedBefore}} {
		if t.v == "" {
			continue
		}
		at, err := time.Parse(timeForm, t.v)
		if err != nil {
			bad = append(bad, fmt.Sprintf("%q is not a time (YYYY-MM-DDTHH:MM, UTC)", t.v))
			continue
		}
		*t.out = at
	}
	if len(bad) > 0 {
		w.Header().Set("Content-Type", "text/html; charset=utf-8")
		w.WriteHeader(http.StatusBadRequest)
		h.render(w, r, "runs", u, map[string]any{"Title": "Runs", "Filter": f, "Problem": strings.Join(bad, "; "), "Statuses": statuses})
		return
	}
	started := time.Now()
	runs, nextCursor, err := h.cfg.Store.ListRuns(r.Context(), sq)
	if errors.Is(err, store.ErrInvalidArgument) {
		err = status.Error(codes.InvalidArgument, err.Error())
	} else if err != nil {
		err = status.Error(codes.Unavailable, "cannot list runs now: "+err.Error())
	}
	if err != nil {
		h.fail(w, r, u, "list runs", err)
		return
	}
	w.Header().Set("Server-Timing", fmt.Sprintf("store;dur=%.2f", float64(time.Since(started).Microseconds())/1000))
	data := map[string]any{"Title": "Runs", "Runs": runs, "Filter": f, "Statuses": statuses,
		"Refresh": h.cfg.ListRefresh.Milliseconds(), "Self": "/runs?" + f.query(f.After)}
	if nextCursor != "" {
		data["Next"] = "/runs?" + f.query(nextCursor)
	}
	if f.After != "" {
		data["First"] = "/runs?" + f.query("")
		data["Refresh"] = 0 // a later page stays put
	}
	if q.Get("fragment") == "1" {
		h.renderFragment(w, "runrows", u, data)
		return
	}
	h.render(w, r, "runs", u, data)
}

var statuses = []store.RunStatus{store.StatusPending, store.StatusRunning, store.StatusSucceeded, store.StatusFailed,
	store.StatusCancelled, store.StatusDeadlineExceeded}

// startRun starts a detached run of the user's tenant (an operator's: of the tenant it
// names) from the list page's form, then opens its page.
func (h *Handler) startRun(w http.ResponseWriter, r *http.Request, u *user) {
	if !u.CanChange() {
		h.fail(w, r, u, "start a run", status.Error(codes.PermissionDenied, "a read-only key cannot start runs"))
		return
	}
	req := &orchestratorv1.StartRunRequest{Task: r.PostFormValue("task"), Model: strings.TrimSpace(r.PostFormValue("model"))}
	if t := strings.TrimSpace(r.PostFormValue("timeout")); t != "" {
		d, err := time.ParseDuration(t)
		if err != nil || d <= 0 {
			h.fail(w, r, u, "start a run", status.Errorf(codes.InvalidArgument, "timeout %q is not a positive duration (30s, 5m)", t))
			return
		}
		req.Timeout = durationpb.New(d)
	}
	tenant := u.Tenant()
	if t := strings.TrimSpace(r.PostFormValue("tenant")); t != "" && u.Operator() {
		tenant = t
	}
	resp, err := h.cfg.Orchestrator.StartRun(as(r.Context(), u, tenant), req)
	if err != nil {
		h.fail(w, r, u, "start a run", err)
		return
	}
	http.Redirect(w, r, runPath(resp.GetRun()), http.StatusSeeOther)
}

// runPath is a run's permanent address in the console.
func runPath(run *orchestratorv1.Run) string {
	return "/runs/" + url.PathEscape(run.GetTenant()) + "/" + url.PathEscape(run.GetRunId())
}

// tenantOf is the tenant a run route acts for: the path's, which a tenant's key may name
// only as its own (another is NOT_FOUND, as the API answers for another tenant's run).
func tenantOf(r *http.Request, u *user) (string, error) {
	t := r.PathValue("tenant")
	if !u.Operator() && t != u.Tenant() {
		return "", status.Errorf(codes.NotFound, "run %s not found", r.PathValue("run"))
	}
	return t, nil
}

// getRun reads the run of a run route.
func (h *Handler) getRun(ctx context.Context, r *http.Request, u *user) (*orchestratorv1.Run, error) {
	tenant, err := tenantOf(r, u)
	if err != nil {
		return nil, err
	}
	resp, err := h.cfg.Orchestrator.GetRun(as(ctx, u, tenant), &orchestratorv1.GetRunRequest{RunId: r.PathValue("run")})
	if err != nil {
		return nil, err
	}
	if resp.GetRun().GetTenant() == "" {
		resp.Run.Tenant = tenant
	}
	return resp.GetRun(), nil
}

// pendingGates are the run's approval requests waiting for a decision, for an operator
// who may decide them; nil for everyone else.
func (h *Handler) pendingGates(ctx context.Context, u *user, run *orchestratorv1.Run) map[string]*meshv1.ApprovalGate {
	if !u.Admin() || run.GetEndedAt() != nil {
		return nil
	}
	resp, err := h.cfg.Admin.ListApprovals(as(ctx, u, ""), &adminv1.ListApprovalsRequest{PendingOnly: true, Tenant: run.GetTenant(), RunId: run.GetRunId()})
	if err != nil {
		h.cfg.Log.WarnContext(ctx, "console: list approvals", "run_id", run.GetRunId(), "error", err.Error())
		return nil
	}
	out := map[string]*meshv1.ApprovalGate{}
	for _, a := range resp.GetApprovals() {
		out[a.GetNodeId()] = &meshv1.ApprovalGate{State: "pending", Tool: a.GetTool(), Why: a.GetWhy(), ExpiresAt: a.GetExpiresAt()}
	}
	return out
}

// runPage shows a run: its figures, its timeline, its nodes, and what may be done.
func (h *Handler) runPage(w http.ResponseWriter, r *http.Request, u *user) {
	run, err := h.getRun(r.Context(), r, u)
	if err != nil {
		h.fail(w, r, u, "show the run", err)
		return
	}
	v := h.view(r.Context(), u, run, "", h.pendingGates(r.Context(), u, run))
	data := map[string]any{"Title": "Run " + run.GetRunId(), "V": v, "Path": runPath(run), "ServerNowMS": time.Now().UnixMilli()}
	if h.cfg.TraceURL != "" {
		data["Trace"] = strings.ReplaceAll(h.cfg.TraceURL, "{run_id}", url.QueryEscape(run.GetRunId()))
	}
	h.render(w, r, "run", u, data)
}

// runView answers the live part of a run's page alone (the page's script fetches it when
// its event stream cannot be kept open).
func (h *Handler) runView(w http.ResponseWriter, r *http.Request, u *user) {
	run, err := h.getRun(r.Context(), r, u)
	if err != nil {
		http.Error(w, status.Convert(err).Message(), httpStatus(err))
		return
	}
	h.renderFragment(w, "runview", u, h.view(r.Context(), u, run, "", h.pendingGates(r.Context(), u, run)))
}

func (h *Handler) view(_ context.Context, u *user, run *orchestratorv1.Run, text string, pending map[string]*meshv1.ApprovalGate) *runView {
	v := newRunView(run, time.Now(), text, pending)
	v.CanChange, v.Admin, v.CSRF = u.CanChange(), u.Admin(), h.seal.token(u.ID)
	return v
}

// viewEvery is how often, at most, the event stream sends the run's view while events
// arrive: a node event reaches the page within it plus the render.
const viewEvery = 50 * time.Millisecond

// quietRefresh is how long an event stream waits for a watch event before it reads the
// run afresh.
const quietRefresh = 2 * time.Second

// runEvents streams a run's view as Server-Sent Events ("view": the live part of the
// page, re-rendered; "end": the run ended), following WatchRun, which any replica
// relays from the run's owner. A run still running is re-rendered every second too, for
// its bars' growth.
func (h *Handler) runEvents(w http.ResponseWriter, r *http.Request, u *user) {
	fl, ok := w.(http.Flusher)
	if !ok {
		http.Error(w, "streaming unsupported", http.StatusInternalServerError)
		return
	}
	ctx, cancel := context.WithCancel(r.Context())
	defer cancel()
	run, err := h.getRun(ctx, r, u)
	if err != nil {
		http.Error(w, status.Convert(err).Message(), httpStatus(err))
		return
	}
	pending := h.pendingGates(ctx, u, run)
	if pending == nil {
		pending = map[string]*meshv1.ApprovalGate{}
	}
	w.Header().Set("Content-Type", "text/event-stream")
	w.Header().Set("X-Accel-Buffering", "no") // an nginx ingress would hold the events back
	w.WriteHeader(http.StatusOK)

	type update struct {
		msg *orchestratorv1.WatchRunResponse
		err error
	}
	events := make(chan update, 64)
	if run.GetEndedAt() == nil {
		stream, err := h.cfg.Orchestrator.WatchRun(as(ctx, u, run.GetTenant()), &orchestratorv1.WatchRunRequest{RunId: run.GetRunId()})
		if err != nil {
			events <- update{err: err}
			close(events)
		} else {
			go func() {
				defer close(events)
				for {
					m, err := stream.Recv()
					select {
					case events <- update{m, err}:
					case <-ctx.Done():
						return
					}
					if err != nil {
						return
					}
				}
			}()
		}
	} else {
		close(events)
	}

	texts := map[string]string{} // model node → its text so far
	lastText := ""
	send := func(event string) bool {
		var b bytes.Buffer
		if event == "view" {
			if err := h.pages["run"].ExecuteTemplate(&b, "runview", h.view(ctx, u, run, lastText, pending)); err != nil {
				h.cfg.Log.ErrorContext(ctx, "console: render", "error", err.Error())
				return false
			}
		}
		if err := writeEvent(w, event, b.String()); err != nil {
			return false
		}
		fl.Flush()
		return true
	}
	if !send("view") {
		return
	}
	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	var flush <-chan time.Time
	dirty, lastEvent := false, time.Now()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
			if run.GetEndedAt() != nil {
				continue
			}
			// A watch that has said nothing for a while (a run quiet between steps, or
			// a watch that reached a replica with no node events for it) is made good
			// by reading the run afresh: GetRun asks every replica's node reports.
			if time.Since(lastEvent) >= quietRefresh {
				if fresh, err := h.getRun(ctx, r, u); err == nil && len(fresh.GetNodes()) >= len(run.GetNodes()) {
					run, lastEvent = fresh, time.Now()
				}
			}
			if !send("view") {
				return
			}
		case <-flush:
			flush, dirty = nil, false
			if !send("view") {
				return
			}
		case up, open := <-events:
			if !open || up.err != nil {
				if up.err != nil && !errors.Is(up.err, io.EOF) && ctx.Err() == nil {
					h.cfg.Log.DebugContext(ctx, "console: watch ended", "run_id", run.GetRunId(), "error", up.err.Error())
				}
				// The summary (or the run as it is now, if the watch broke off).
				if fresh, err := h.getRun(ctx, r, u); err == nil {
					run = fresh
				}
				if !send("view") {
					return
				}
				if run.GetEndedAt() != nil {
					send("end")
				}
				return
			}
			applyEvent(run, up.msg, texts, pending, &lastText)
			lastEvent = time.Now()
			if !dirty {
				dirty = true
				flush = time.After(viewEvery)
			}
		}
	}
}

// applyEvent folds one WatchRun event into the run the stream renders.
func applyEvent(run *orchestratorv1.Run, m *orchestratorv1.WatchRunResponse, texts map[string]string,
	pending map[string]*meshv1.ApprovalGate, lastText *string) {
	switch {
	case m.GetNode() != nil:
		n := m.GetNode()
		for i, old := range run.GetNodes() {
			if old.GetId() == n.GetId() {
				run.Nodes[i] = n
				return
			}
		}
		run.Nodes = append(run.Nodes, n)
	case m.GetFinished() != nil:
		fin := proto.Clone(m.GetFinished()).(*orchestratorv1.Run)
		if fin.GetTenant() == "" {
			fin.Tenant = run.GetTenant()
		}
		proto.Reset(run)
		proto.Merge(run, fin)
	case m.GetNodeEvent() != nil:
		ev := m.GetNodeEvent()
		switch {
		case ev.GetText() != nil:
			t := texts[ev.GetNodeId()]
			off := int(ev.GetText().GetOffset())
			if off <= len(t) {
				t = t[:off] + ev.GetText().GetText()
			} else {
				t = ev.GetText().GetText() // the watch joined late: what it has
			}
			texts[ev.GetNodeId()], *lastText = t, t
		case ev.GetApproval() != nil:
			pending[ev.GetNodeId()] = ev.GetApproval()
		}
	}
}

// writeEvent writes one Server-Sent Event; data may span lines.
func writeEvent(w io.Writer, event, data string) error {
	var b strings.Builder
	b.WriteString("event: " + event + "\n")
	for _, line := range strings.Split(data, "\n") {
		b.WriteString("data: " + line + "\n")
	}
	b.WriteString("\n")
	_, err := io.WriteString(w, b.String())
	return err
}

// cancelRun cancels a run with cause operator and the form's reason; its page then shows
// the tree stopping.
func (h *Handler) cancelRun(w http.ResponseWriter, r *http.Request, u *user) {
	tenant, err := tenantOf(r, u)
	if err == nil && !u.CanChange() {
		err = status.Error(codes.PermissionDenied, "a read-only key cannot cancel runs")
	}
	if err == nil {
		reason := strings.TrimSpace(r.PostFormValue("reason"))
		if reason == "" {
			reason = "cancelled from the web console"
		}
		_, err = h.cfg.Orchestrator.CancelRun(as(r.Context(), u, tenant), &orchestratorv1.CancelRunRequest{RunId: r.PathValue("run"), Reason: reason})
	}
	if err != nil {
		h.fail(w, r, u, "cancel the run", err)
		return
	}
	http.Redirect(w, r, "/runs/"+url.PathEscape(tenant)+"/"+url.PathEscape(r.PathValue("run")), http.StatusSeeOther)
}

// decide approves or denies a node's pending tool call (operators with the admin scope:
// AdminService.DecideApproval decides, and refuses anyone else).
func (h *Handler) decide(w http.ResponseWriter, r *http.Request, u *user) {
	tenant, err := tenantOf(r, u)
	if err == nil {
		decision := r.PostFormValue("decision")
		if decision != "approve" && decision != "deny" {
			err = status.Errorf(codes.InvalidArgument, "decision must be approve or deny, not %q", decision)
		} else {
			_, err = h.cfg.Admin.DecideApproval(as(r.Context(), u, ""), &adminv1.DecideApprovalRequest{RunId: r.PathValue("run"),
				NodeId: r.PostFormValue("node"), Approve: decision == "approve", Reason: strings.TrimSpace(r.PostFormValue("reason")), Tenant: tenant})
		}
	}
	if err != nil {
		h.fail(w, r, u, "decide the approval", err)
		return
	}
	http.Redirect(w, r, "/runs/"+url.PathEscape(tenant)+"/"+url.PathEscape(r.PathValue("run")), http.StatusSeeOther)
}
