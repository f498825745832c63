package console

import (
	"net/http"
	"net/url"
	"sort"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	adminv1 "github.com/curfew-mesh/curfew/gen/curfew/admin/v1"
	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
	"github.com/curfew-mesh/curfew/mesh/store"
)

// health shows AdminService.Status: pools, breakers per target, decoders and their lease
// ages, the orphan delta, coordination, and the dead letters waiting. The admin service
// decides who may see it (operators' keys).
func (h *Handler) health(w http.ResponseWriter, r *http.Request, u *user) {
	st, err := h.cfg.Admin.Status(as(r.Context(), u, ""), &adminv1.StatusRequest{})
	if err != nil {
		h.fail(w, r, u, "read the mesh's status", err)
		return
	}
	leases := st.GetLeases()
	sort.SliceStable(leases, func(i, j int) bool { return leases[i].GetAge().AsDuration() > leases[j].GetAge().AsDuration() })
	dls, _, err := h.cfg.Store.ListDeadLetters(r.Context(), store.DeadLetterQuery{Limit: 20})
	if err != nil {
		h.cfg.Log.WarnContext(r.Context(), "console: list dead letters", "error", err.Error())
	}
	h.render(w, r, "health", u, map[string]any{"Title": "Health", "S": st, "Leases": leases, "DeadLetters": dls,
		"Read": time.Now().UTC().Format(time.RFC3339)})
}

// deadLetters lists the dead letters waiting: the tenant's, or every tenant's for an
// operator.
func (h *Handler) deadLetters(w http.ResponseWriter, r *http.Request, u *user) {
	q := store.DeadLetterQuery{IncludeReplayed: r.URL.Query().Get("replayed") == "1", After: r.URL.Query().Get("after"), Limit: listPage}
	if !u.Operator() {
		q.Tenant = u.Tenant()
	}
	dls, next, err := h.cfg.Store.ListDeadLetters(r.Context(), q)
	if err != nil {
		h.fail(w, r, u, "list dead letters", status.Error(codes.Unavailable, "cannot list dead letters now: "+err.Error()))
		return
	}
	data := map[string]any{"Title": "Dead letters", "DeadLetters": dls, "Replayed": q.IncludeReplayed}
	if next != "" {
		v := url.Values{"after": {next}}
		if q.IncludeReplayed {
			v.Set("replayed", "1")
		}
		data["Next"] = "/dead-letters?" + v.Encode()
	}
	h.render(w, r, "deadletters", u, data)
}

// replay replays a dead letter through DeadLetterService.ReplayDeadLetter (which runs its
// step once, however often it is asked) and opens the run it started.
func (h *Handler) replay(w http.ResponseWriter, r *http.Request, u *user) {
	tenant := r.PathValue("tenant")
	var err error
	if !u.Operator() && tenant != u.Tenant() {
		err = status.Errorf(codes.NotFound, "dead letter %s not found", r.PathValue("id"))
	} else if !u.CanChange() {
		err = status.Error(codes.PermissionDenied, "a read-only key cannot replay dead letters")
	} else if h.cfg.DeadLetters == nil {
		err = status.Error(codes.FailedPrecondition, "this orchestrator keeps no dead letters (no shared store)")
	}
	var resp *orchestratorv1.ReplayDeadLetterResponse
	if err == nil {
		resp, err = h.cfg.DeadLetters.ReplayDeadLetter(as(r.Context(), u, tenant), &orchestratorv1.ReplayDeadLetterRequest{Id: r.PathValue("id")})
	}
	if err != nil {
		h.fail(w, r, u, "replay the dead letter", err)
		return
	}
	if resp.GetRunId() != "" {
		http.Redirect(w, r, "/runs/"+url.PathEscape(tenant)+"/"+url.PathEscape(resp.GetRunId()), http.StatusSeeOther)
		return
	}
	http.Redirect(w, r, "/dead-letters", http.StatusSeeOther)
}
