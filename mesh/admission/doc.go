// Package admission is curfew's admission controller: the orchestrator asks it once per
// run, before any work starts, whether the run may start now, must wait, or is shed.
//
// # Use
//
//	c, err := admission.New(cfg, registry) // cfg from admission.Load(path) or DefaultConfig
//	...
//	t, err := c.Admit(ctx, admission.Request{Tenant: tenant, Criticality: crit, Class: model, ExpectedTokens: n})
//	if err != nil {
//		return err // a *ShedError is already a gRPC status (RESOURCE_EXHAUSTED + RetryInfo + ErrorInfo)
//	}
//	defer t.Release(admission.Outcome{Tokens: spent, Service: elapsed, Ended: admission.EndCompleted})
//
// Admit blocks while the run is queued; ctx carries the run's absolute deadline. The
// orchestrator also feeds the cancel path's evidence: [Controller.ObserveOrphanTokens]
// per finished run, [Controller.ObserveCancelPropagation] per cancel,
// [Controller.ObserveRetryWithoutID] per retry that arrived without its retry-id.
//
// # Pools and criticality
//
// Pools are named and configured ([PoolConfig]): MaxInFlight slots, a queue of at most
// MaxQueue runs, waiting at most MaxQueueAge. A request names its pool, or gets one from
// its criticality: critical (the default) → the first pool, sheddable → the pool marked
// Overflow (the first pool when none is). Each pool has two FIFO queues; a free slot goes
// to the oldest critical waiter, and to the oldest sheddable one only when no critical
// one waits. When the queue is full, a critical arrival evicts the newest sheddable
// waiter (shed with queue_full); a sheddable arrival, or a critical one with no
// sheddable waiter to evict, is shed itself. Sheddable work is shed first.
//
// # Shed rules
//
// In the order they are checked at arrival:
//
//   - pool_closed: an operator closed the pool (condition operator,
//     [Controller.SetOperatorControls]), or the overflow pool has failed closed (below).
//   - deadline_slack: seed 003's rule "shed if lease_age + cancel_grace > deadline_slack":
//     expected service time + Config.CancelGrace > time left before ctx's deadline. The
//     expected service time is Request.Expected when declared, else the median of the
//     last ServiceSamples completed runs of Request.Class, 0 before the first (only the
//     cancel grace counts until a class has been observed). The rule is checked again
//     when the run leaves the queue, and a queued run is shed as soon as its slack runs
//     out, before its deadline.
//   - tenant_concurrency: the tenant already has TenantLimits.MaxInFlight runs admitted
//     or queued (queued runs count, so one tenant cannot fill a queue).
//   - budget: the tenant's settled tokens in the current window + its reservations + the
//     run's ExpectedTokens (at least 1) exceed TenantLimits.TokenBudget.
//   - queue_full: see above.
//   - queue_age: the run waited MaxQueueAge in the queue.
//   - shutdown: Close was called (UNAVAILABLE rather than RESOURCE_EXHAUSTED).
//
// A shed is a *[ShedError]; its GRPCStatus is RESOURCE_EXHAUSTED with a RetryInfo and an
// ErrorInfo {Reason "SHED_<REASON>", Domain "curfew.dev", Metadata pool, tenant[,
// condition]}. [AsShed] reads one back, also from the wire. A caller whose ctx ends while
// queued gets ctx's status (CANCELED or DEADLINE_EXCEEDED), not a shed.
//
// # Failing closed
//
// The overflow pool is optional capacity whose cancel path must be proven. It closes for
// Config.FailClosedWindow after the last occurrence of any of: orphan tokens above zero,
// a cancel that propagated slower than the slack it had, a retry without its retry-id.
// While closed it refuses every run with pool_closed (naming the conditions) and its
// queue is shed; runs already admitted keep running. [Controller.Closed] reports it.
//
// # Budgets
//
// Token budgets are per tenant per fixed window aligned to the Unix epoch. Admission
// reserves Request.ExpectedTokens; [Ticket.Release] replaces the reservation with the
// actual spend, charged to the window in which the run ends, so a run that ended early
// returns the difference. Limits come from the config ([Config.TenantLimits]) or a
// [LimitSource].
//
// # Across replicas
//
// With [Config.Cluster] (a [clusterslots.Holder] on a shared store), pool caps and
// tenant concurrency hold across every replica: the head of a pool's queue claims a slot
// of the pool's scope ([PoolScope]) and of its tenant's ([TenantScope]) in one store
// statement, outside the lock, in queue order; a full pool waits for a
// release ([Controller.Kick]) or the poll, a tenant at its cluster-wide limit is shed
// tenant_concurrency. When the store fails, each replica admits up to its share of each
// cap for DegradedFor ([Controller.ClusterStatus]). docs/cluster.md is the operator's
// view.
//
// # Cost
//
// One mutex guards the controller; every decision is O(1) in the queue length
// (intrusive lists, map lookups). Without Config.Cluster the controller starts no
// goroutines: a queued caller waits in its own goroutine, on its result, its ctx and one
// timer for its queue age and slack. With it, each claim runs in a goroutine of its own
// (at most as many per pool as it has room for), and a waiting pool has one poll timer;
// Close waits for them.
//
// # Metrics
//
// curfew_admission_queue_depth{pool}, curfew_admission_queue_age_seconds{pool},
// curfew_admission_in_flight{pool}, curfew_admission_pool_closed{pool},
// curfew_shed_total{service,reason}, and the cluster-wide ones
// (curfew_admission_cluster_claims_total{pool,result} with Config.Cluster,
// curfew_admission_cluster_claim_seconds, _degraded, _local_admits_total,
// _slots_lost_total), every series present from New. docs/admission.md is
// the operator's view.
package admission
