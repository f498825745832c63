package nodes

import (
	"context"
	"sort"
	"strings"
	"sync"
	"time"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	"github.com/curfew-mesh/curfew/mesh/md"
)

// DefaultRetention is how long a run's nodes are kept after its last node ended.
const DefaultRetention = 15 * time.Minute

// Table holds the nodes this process executes, by run. The zero value is not usable;
// call New. It is safe for concurrent use.
type Table struct {
	mu        sync.Mutex
	runs      map[string]*run
	retention time.Duration
}

type run struct {
	nodes   map[string]*meshv1.Node
	cancels map[string]context.CancelCauseFunc // running nodes begun with Begin
	running int
	lastEnd time.Time
	changed chan struct{} // closed and replaced on every end
}

// New returns an empty table that forgets a run retention after its last node ended
// (DefaultRetention when retention <= 0) once Sweep is called.
func New(retention time.Duration) *Table {
	if retention <= 0 {
		retention = DefaultRetention
	}
	return &Table{runs: make(map[string]*run), retention: retention}
}

func (t *Table) runLocked(id string) *run {
	r := t.runs[id]
	if r == nil {
		r = &run{nodes: make(map[string]*meshv1.Node), cancels: make(map[string]context.CancelCauseFunc), changed: make(chan struct{})}
		t.runs[id] = r
	}
	return r
}

// Start records node n of run as running, stamping its start time. It returns a copy. A
// new attempt of a node that has ended keeps the earlier attempt in EarlierAttempts.
func (t *Table) Start(runID string, n *meshv1.Node) *meshv1.Node {
	n = proto.Clone(n).(*meshv1.Node)
	n.Status = meshv1.NodeStatus_NODE_STATUS_RUNNING
	if n.StartedAt == nil {
		n.StartedAt = timestamppb.Now()
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	r := t.runLocked(runID)
	if old, ok := r.nodes[n.Id]; ok {
		if old.Status == meshv1.NodeStatus_NODE_STATUS_RUNNING {
			r.running--
		}
		n.EarlierAttempts = append(old.EarlierAttempts, &meshv1.AttemptRecord{
			Attempt: old.Attempt, RetryId: old.RetryId, Status: old.Status, Cause: old.Cause,
			ErrorCode: old.ErrorCode, StartedAt: old.StartedAt, EndedAt: old.EndedAt})
	}
	r.nodes[n.Id] = n
	r.running++
	return proto.Clone(n).(*meshv1.Node)
}

// Begin records node n of run as running, like Start, and returns a context derived from
// ctx that Cancel (and so NodeReportService.CancelNodes) can cancel with a cause. The node's
// work must run under the returned context and end with End or Finish, which release it.
func (t *Table) Begin(ctx context.Context, runID string, n *meshv1.Node) (context.Context, *meshv1.Node) {
	cctx, cancel := context.WithCancelCause(ctx)
	if id := md.IdentityFrom(ctx); id.RetryID != "" && n.RetryId == "" {
		n = proto.Clone(n).(*meshv1.Node)
		n.RetryId, n.Attempt = id.RetryID, int32(max(id.Attempt, 1))
	}
	n = t.Start(runID, n)
	t.mu.Lock()
	if old := t.runs[runID].cancels[n.Id]; old != nil {
		old(nil)
	}
	t.runs[runID].cancels[n.Id] = cancel
	t.mu.Unlock()
	return cctx, n
}

// Cancel cancels the running nodes of run selected by prefixes (all when empty) that were
// begun with Begin, with cause, and returns how many it cancelled.
func (t *Table) Cancel(runID string, prefixes []string, cause error) int {
	t.mu.Lock()
	defer t.mu.Unlock()
	r := t.runs[runID]
	if r == nil {
		return 0
	}
	n := 0
	for id, cancel := range r.cancels {
		if Selected(id, prefixes) {
			cancel(cause)
			n++
		}
	}
	return n
}

// Update applies fn to the node under the table's lock and returns a copy of the result,
// or nil when the node is unknown.
func (t *Table) Update(runID, id string, fn func(*meshv1.Node)) *meshv1.Node {
	t.mu.Lock()
	defer t.mu.Unlock()
	r := t.runs[runID]
	if r == nil || r.nodes[id] == nil {
		return nil
	}
	n := r.nodes[id]
	fn(n)
	return proto.Clone(n).(*meshv1.Node)
}

// End marks a running node ended with status st and, when it was cancelled, cause; errCode
// and errMsg describe a failure. fn, if not nil, may set further fields. It returns a copy.
func (t *Table) End(runID, id string, st meshv1.NodeStatus, cause meshv1.CancelCause, errCode, errMsg string, fn func(*meshv1.Node)) *meshv1.Node {
	now := time.Now()
	t.mu.Lock()
	defer t.mu.Unlock()
	r := t.runs[runID]
	if r == nil || r.nodes[id] == nil {
		return nil
	}
	n := r.nodes[id]
	if n.Status == meshv1.NodeStatus_NODE_STATUS_RUNNING {
		r.running--
	}
	n.Status, n.Cause, n.ErrorCode, n.ErrorMessage = st, cause, errCode, errMsg
	n.EndedAt = timestamppb.New(now)
	if fn != nil {
		fn(n)
	}
	if c := r.cancels[id]; c != nil {
		c(nil) // release the context Begin made; the node's work is over
		delete(r.cancels, id)
	}
	r.lastEnd = now
	close(r.changed)
	r.changed = make(chan struct{})
	return proto.Clone(n).(*meshv1.Node)
}

// Note records that this process cancelled node id (which another process executes) with
// cause at instant at. Merge folds notes into the executor's record.
func (t *Table) Note(runID, id string, cause meshv1.CancelCause, at time.Time) {
	t.mu.Lock()
	defer t.mu.Unlock()
	r := t.runLocked(runID)
	key := "note:" + id
	if _, ok := r.nodes[key]; ok {
		return // the first cancel wins
	}
	r.nodes[key] = &meshv1.Node{Id: id, Cause: cause, CancelledAt: timestamppb.New(at)}
}

// List returns copies of the run's nodes (and notes) selected by prefixes (all when empty).
// When settle > 0 it first waits, up to settle or until ctx is done, for every selected
// node to end; settled reports whether they all had.
func (t *Table) List(ctx context.Context, runID string, prefixes []string, settle time.Duration) (out []*meshv1.Node, settled bool) {
	var timeout <-chan time.Time
	if settle > 0 {
		tm := time.NewTimer(settle)
		defer tm.Stop()
		timeout = tm.C
	}
	for {
		t.mu.Lock()
		r := t.runs[runID]
		if r == nil {
			t.mu.Unlock()
			return nil, true
		}
		out, running := out[:0], 0
		for _, n := range r.nodes {
			if !Selected(n.Id, prefixes) {
				continue
			}
			if n.Status == meshv1.NodeStatus_NODE_STATUS_RUNNING {
				running++
			}
			out = append(out, proto.Clone(n).(*meshv1.Node))
		}
		changed := r.changed
		t.mu.Unlock()
		if running == 0 || settle <= 0 {
			sortNodes(out)
			return out, running == 0
		}
		select {
		case <-changed:
		case <-timeout:
			sortNodes(out)
			return out, false
		case <-ctx.Done():
			sortNodes(out)
			return out, false
		}
	}
}

// Sweep forgets runs whose nodes have all ended more than the retention ago.
func (t *Table) Sweep(now time.Time) {
	t.mu.Lock()
	defer t.mu.Unlock()
	for id, r := range t.runs {
		if r.running == 0 && !r.lastEnd.IsZero() && now.Sub(r.lastEnd) > t.retention {
			delete(t.runs, id)
		}
	}
}

// Selected reports whether node id equals one of prefixes or lies beneath one.
func Selected(id string, prefixes []string) bool {
	if len(prefixes) == 0 {
		return true
	}
	for _, p := range prefixes {
		if id == p || strings.HasPrefix(id, p+"/") {
			return true
		}
	}
	return false
}

// Parent returns the parent path of a node id, "" for the root.
func Parent(id string) string {
	i := strings.LastIndexByte(id, '/')
	if i < 0 {
		return ""
	}
	return id[:i]
}

func sortNodes(ns []*meshv1.Node) {
	sort.SliceStable(ns, func(i, j int) bool { return ns[i].Id < ns[j].Id })
}

// Runs returns the ids of the runs the table holds.
func (t *Table) Runs() []string {
	t.mu.Lock()
	defer t.mu.Unlock()
	out := make([]string, 0, len(t.runs))
	for id := range t.runs {
		out = append(out, id)
	}
	return out
}
