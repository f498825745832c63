// Package budget is the per-call token reservation against a tenant's budget: before a
// model call starts, the tokens it may spend (its prompt plus its max_tokens) are
// reserved in the tenant's current budget window; when the call ends, however it ends,
// the reservation is settled to the tokens actually spent. A call the budget cannot
// cover is refused before it starts.
//
// # Use
//
//	b := budget.NewMemory(cfg, budget.Options{Registry: reg}) // cfg: an admission.Config
//	// or, across replicas: budget.NewShared(budget.SharedConfig{Store: st, Limits: cfg})
//	h, err := b.Reserve(ctx, tenant, prompt+maxTokens)
//	if err != nil {
//		return err // a *Refusal: RESOURCE_EXHAUSTED with ErrorInfo BUDGET_EXHAUSTED
//	}
//	defer func() { h.Settle(spent) }() // on every way out: EOF, error, cancel
//
// # The rule
//
// A tenant's budget is admission's: TokenBudget tokens per fixed Window, windows aligned
// to the Unix epoch (admission.TenantLimits, read from the same --admission-config file).
// A reservation of n is granted when
//
//	spent in this window + reserved by calls in flight + n <= budget
//
// and refused otherwise (n < 1 counts as 1, so a tenant whose budget is used up starts
// nothing). Settle removes the reservation and charges the actual spend to the window in
// which the call ends; reservations carry over a window boundary (their calls are still
// running). A call that spent more than it reserved is charged what it spent: the
// reservation is a bound the caller computes, and the ledger is the truth. A tenant
// without a budget (TokenBudget 0) reserves nothing: [Budgets.Reserve] returns a no-op
// [Hold] without taking a lock.
//
// # Where it holds
//
// [Memory] counts in the memory of one process: with several modelproxy replicas each
// enforces the whole budget on the calls it serves. The reservations of a process that
// crashes go with its memory; the spend its ledger persisted stays in the store.
//
// [Shared] reserves in the store (store.Budgets) that every replica shares, so they
// enforce a tenant's budget together (docs/cluster.md, "Budgets across replicas"): one
// round trip to reserve, one to settle, and one renewal statement per TTL/3 for all of
// a process's holds; a crashed replica's reservations stop counting TTL after its last
// renewal, and each is then charged what the token ledger has of its call (the caller
// names the call's ledger entries with [WithLedger]), so a crash hides no spend. While the store is unreachable a Shared reserves against this replica's
// share of what the tenant had left (the remaining budget / live replicas), keeps its
// settlements for the store, and coordinates again once the store answers.
// modelproxy uses Shared when its store is shared, Memory otherwise.
//
// [Refused] recognises a refusal, here or after it crossed the wire, so that an agent
// loop does not hand it to the model as a tool's error and cancels the run's tree with
// cause budget instead.
package budget
