package nodes

import (
	"context"
	"slices"
	"sort"
	"strings"
	"sync"
	"time"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	"github.com/curfew-mesh/curfew/mesh/cancel"
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
	nodes   smallMap[*meshv1.Node]
	cancels smallMap[nodeCancel] // running nodes begun with Begin
	running int
	lastEnd time.Time
	// waiters are the Lists waiting for their selected nodes to end.
	waiters []*waiter
	// summarized are the ended nodes a summary has listed (Server.Summarized); nil
	// until the first.
	summarized map[string]struct{}
	// stopped are the run's cancels (CancelRun): a node they select may not begin
	// afterwards with BeginLive.
	stopped []stop
}

// stop is one CancelRun of a run: the nodes it selected, and its cause.
type stop struct {
	prefixes []string
	cause    error
}

// waiter is a List waiting until no node it selects is running. Ends and starts count
// down and up its running; it is woken once, when that reaches 0, rather than on every
// end (during a teardown dozens of waiters would each rescan the run on each of dozens of
// ends, under the lock the ending nodes need).
type waiter struct {
	prefixes []string
	running  int
	done     chan struct{}
}

// changedLocked updates the waiters of r for node id turning running (or not).
func (r *run) changedLocked(id string, wasRunning, isRunning bool) {
	if wasRunning == isRunning || len(r.waiters) == 0 {
		return
	}
	kept := r.waiters[:0]
	for _, w := range r.waiters {
		if Selected(id, w.prefixes) {
			if isRunning {
				w.running++
			} else if w.running--; w.running == 0 {
				close(w.done)
				continue
			}
		}
		kept = append(kept, w)
	}
	clear(r.waiters[len(kept):])
	r.waiters = kept
}

func isRunning(n *meshv1.Node) bool { return n.GetStatus() == meshv1.NodeStatus_NODE_STATUS_RUNNING }

// nodeCancel cancels a node begun with Begin. owned: Begin derived the context, and End
// releases it; otherwise it is the call's own (cancel.Take), released by its maker.
type nodeCancel struct {
	fn    context.CancelCauseFunc
	owned bool
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
		r = &run{}
		t.runs[id] = r
	}
	return r
}

// Start records node n of run as running, stamping its start time. It returns a copy. A
// new attempt of a node that has ended keeps the earlier attempt in EarlierAttempts.
func (t *Table) Start(runID string, n *meshv1.Node) *meshv1.Node {
	n, _ = t.start(runID, n, "", 0, nodeCancel{}, false)
	defer t.mu.Unlock()
	return proto.Clone(n).(*meshv1.Node)
}

// start records a copy of n (with retryID and attempt when retryID is not empty) and
// returns it with t.mu held. nc, if set, is registered as the node's cancel. With live,
// a node a CancelRun of the run selected is not recorded: the cancel's cause is returned
// (t.mu still held).
func (t *Table) start(runID string, n *meshv1.Node, retryID string, attempt int32, nc nodeCancel, live bool) (*meshv1.Node, error) {
	n = proto.Clone(n).(*meshv1.Node)
	n.Status = meshv1.NodeStatus_NODE_STATUS_RUNNING
	if n.StartedAt == nil {
		n.StartedAt = timestamppb.Now()
	}
	if retryID != "" {
		n.RetryId, n.Attempt = retryID, attempt
	}
	t.mu.Lock()
	if live {
		if r := t.runs[runID]; r != nil {
			for _, st := range r.stopped {
				if Selected(n.Id, st.prefixes) {
					return nil, st.cause
				}
			}
		}
	}
	r := t.runLocked(runID)
	old, hadOld := r.nodes.get(n.Id)
	if hadOld {
		if isRunning(old) {
			r.running--
		}
		earlier := make([]*meshv1.AttemptRecord, 0, len(old.EarlierAttempts)+1)
		n.EarlierAttempts = append(append(earlier, old.EarlierAttempts...), &meshv1.AttemptRecord{
			Attempt: old.Attempt, RetryId: old.RetryId, Status: old.Status, Cause: old.Cause,
			ErrorCode: old.ErrorCode, StartedAt: old.StartedAt, EndedAt: old.EndedAt})
	}
	r.nodes.set(n.Id, n)
	r.running++
	r.changedLocked(n.Id, hadOld && isRunning(old), true)
	if nc.fn != nil {
		if old, _ := r.cancels.get(n.Id); old.fn != nil {
			old.fn(nil)
		}
		r.cancels.set(n.Id, nc)
	}
	return n, nil
}

// Begin records node n of run as running, like Start, and returns a context that Cancel
// (and so NodeReportService.CancelNodes) can cancel with a cause: ctx itself when it is a
// call's cancel.WithHandle context whose cancel func is free (the server chain's, which
// the call's handler receives), otherwise a context derived from ctx. The node's work must
// run under the returned context and end with End or Finish, which release a derived one.
func (t *Table) Begin(ctx context.Context, runID string, n *meshv1.Node) (context.Context, *meshv1.Node) {
	cctx, n, _ := t.begin(ctx, runID, n, false)
	return cctx, n
}

// BeginLive is Begin for work that must not start once its run was cancelled: when a
// CancelRun of the run selected n, it records nothing and returns that cancel's cause
// (a cancel.Err* error). The check and the start are one step under the table's lock,
// so a cancel either refuses the node or finds it running and cancels it.
func (t *Table) BeginLive(ctx context.Context, runID string, n *meshv1.Node) (context.Context, *meshv1.Node, error) {
	return t.begin(ctx, runID, n, true)
}

func (t *Table) begin(ctx context.Context, runID string, n *meshv1.Node, live bool) (context.Context, *meshv1.Node, error) {
	cctx := ctx
	nc := nodeCancel{}
	if fn, ok := cancel.Take(ctx); ok {
		nc.fn = fn
	} else {
		cctx, nc.fn = context.WithCancelCause(ctx)
		nc.owned = true
	}
	var retryID string
	var attempt int32
	if id := md.IdentityFrom(ctx); id.RetryID != "" && n.RetryId == "" {
		retryID, attempt = id.RetryID, int32(max(id.Attempt, 1)) //nolint:gosec // recorded for display only; retries are ordered on the int
	}
	n, err := t.start(runID, n, retryID, attempt, nc, live)
	if err != nil {
		t.mu.Unlock()
		if nc.owned {
			nc.fn(nil)
		}
		return nil, nil, err
	}
	// The copy is taken under the lock: the table's node changes when it ends.
	n = proto.Clone(n).(*meshv1.Node)
	t.mu.Unlock()
	return cctx, n, nil
}

// CancelRun is Cancel for a run's cancel (NodeReportService.CancelNodes): besides
// cancelling the selected running nodes, it remembers the cancel, so that a node it
// selects does not begin afterwards with BeginLive (a model call sent just before the
// cancel that arrives just after it). The memory goes with the run's (Sweep).
func (t *Table) CancelRun(runID string, prefixes []string, cause error) int {
	t.mu.Lock()
	r := t.runLocked(runID)
	r.stopped = append(r.stopped, stop{prefixes: slices.Clone(prefixes), cause: cause})
	if r.running == 0 {
		r.lastEnd = time.Now() // a run known only by its cancel is swept like an ended one
	}
	t.mu.Unlock()
	return t.Cancel(runID, prefixes, cause)
}

// Cancel cancels the running nodes of run selected by prefixes (all when empty) that were
// begun with Begin, with cause, and returns how many it cancelled.
func (t *Table) Cancel(runID string, prefixes []string, cause error) int {
	var one [1]context.CancelCauseFunc
	fns := one[:0]
	t.mu.Lock()
	if r := t.runs[runID]; r != nil {
		for id, nc := range r.cancels.all() {
			if Selected(id, prefixes) {
				fns = append(fns, nc.fn)
			}
		}
	}
	t.mu.Unlock()
	// Cancelled outside the lock: each cancel wakes a node's goroutine, whose first step
	// when it stops is to take the lock to record its end.
	for _, fn := range fns {
		fn(cause)
	}
	return len(fns)
}

// Update applies fn to the node under the table's lock and returns a copy of the result,
// or nil when the node is unknown.
func (t *Table) Update(runID, id string, fn func(*meshv1.Node)) *meshv1.Node {
	t.mu.Lock()
	defer t.mu.Unlock()
	r := t.runs[runID]
	if r == nil {
		return nil
	}
	n, _ := r.nodes.get(id)
	if n == nil {
		return nil
	}
	was := isRunning(n)
	fn(n)
	r.changedLocked(id, was, isRunning(n))
	return proto.Clone(n).(*meshv1.Node)
}

// End marks a running node ended with status st and, when it was cancelled, cause; errCode
// and errMsg describe a failure. fn, if not nil, may set further fields. It returns a copy.
func (t *Table) End(runID, id string, st meshv1.NodeStatus, cause meshv1.CancelCause, errCode, errMsg string, fn func(*meshv1.Node)) *meshv1.Node {
	now := time.Now()
	t.mu.Lock()
	defer t.mu.Unlock()
	r := t.runs[runID]
	if r == nil {
		return nil
	}
	n, _ := r.nodes.get(id)
	if n == nil {
		return nil
	}
	was := isRunning(n)
	if was {
		r.running--
	}
	n.Status, n.Cause, n.ErrorCode, n.ErrorMessage = st, cause, errCode, errMsg
	n.EndedAt = timestamppb.New(now)
	if fn != nil {
		fn(n)
	}
	r.changedLocked(id, was, isRunning(n))
	if c, _ := r.cancels.get(id); c.fn != nil {
		if c.owned {
			c.fn(nil) // release the context Begin made; the node's work is over
		}
		r.cancels.del(id)
	}
	r.lastEnd = now
	return proto.Clone(n).(*meshv1.Node)
}

// Note records that this process cancelled node id (which another process executes) with
// cause at instant at. Merge folds notes into the executor's record.
func (t *Table) Note(runID, id string, cause meshv1.CancelCause, at time.Time) {
	t.mu.Lock()
	defer t.mu.Unlock()
	r := t.runLocked(runID)
	key := "note:" + id
	if _, ok := r.nodes.get(key); ok {
		return // the first cancel wins
	}
	r.nodes.set(key, &meshv1.Node{Id: id, Cause: cause, CancelledAt: timestamppb.New(at)})
}

// List returns copies of the run's nodes (and notes) selected by prefixes (all when empty).
// When settle > 0 it first waits, up to settle or until ctx is done, for every selected
// node to end; settled reports whether they all had.
func (t *Table) List(ctx context.Context, runID string, prefixes []string, settle time.Duration) (out []*meshv1.Node, settled bool) {
	t.mu.Lock()
	r := t.runs[runID]
	if r == nil {
		t.mu.Unlock()
		return nil, true
	}
	t.settleLocked(ctx, r, prefixes, settle)
	running := 0
	for _, n := range r.nodes.all() {
		if !Selected(n.Id, prefixes) {
			continue
		}
		if isRunning(n) {
			running++
		}
		out = append(out, proto.Clone(n).(*meshv1.Node))
	}
	t.mu.Unlock()
	sortNodes(out)
	return out, running == 0
}

// Settle waits, up to settle or until ctx is done, for every running node of run selected
// by prefixes to end, and reports whether they all had.
func (t *Table) Settle(ctx context.Context, runID string, prefixes []string, settle time.Duration) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	r := t.runs[runID]
	if r == nil {
		return true
	}
	return t.settleLocked(ctx, r, prefixes, settle) == 0
}

// settleLocked is Settle on r with t.mu held (released while it waits); it returns how
// many selected nodes still run.
func (t *Table) settleLocked(ctx context.Context, r *run, prefixes []string, settle time.Duration) int {
	running := 0
	for _, n := range r.nodes.all() {
		if isRunning(n) && Selected(n.Id, prefixes) {
			running++
		}
	}
	if running == 0 || settle <= 0 {
		return running
	}
	w := &waiter{prefixes: prefixes, running: running, done: make(chan struct{})}
	r.waiters = append(r.waiters, w)
	t.mu.Unlock()
	tm := time.NewTimer(settle)
	select {
	case <-w.done:
	case <-tm.C:
	case <-ctx.Done():
	}
	tm.Stop()
	t.mu.Lock()
	r.dropWaiterLocked(w)
	return w.running
}

// firstSummary reports whether node id of run is listed by a summary for the first
// time, and remembers that it has been.
func (t *Table) firstSummary(runID, id string) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	r := t.runs[runID]
	if r == nil {
		return false
	}
	if _, ok := r.summarized[id]; ok {
		return false
	}
	if r.summarized == nil {
		r.summarized = map[string]struct{}{}
	}
	r.summarized[id] = struct{}{}
	return true
}

// dropWaiterLocked removes w from r's waiters, if it is still there.
func (r *run) dropWaiterLocked(w *waiter) {
	for i, x := range r.waiters {
		if x == w {
			last := len(r.waiters) - 1
			copy(r.waiters[i:], r.waiters[i+1:])
			r.waiters[last] = nil
			r.waiters = r.waiters[:last]
			return
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
