package budget_test

import (
	"context"
	"fmt"
	"time"

	"google.golang.org/grpc/status"

	"github.com/curfew-mesh/curfew/mesh/admission"
	"github.com/curfew-mesh/curfew/mesh/budget"
)

// A model call reserves its prompt plus max_tokens before it starts and settles to what
// it spent; a call the rest of the budget cannot cover is refused before it starts.
func Example() {
	cfg := admission.Config{Tenants: map[string]admission.TenantLimits{
		"acme": {TokenBudget: 500, Window: time.Hour},
	}}
	b := budget.NewMemory(cfg, budget.Options{})
	ctx := context.Background()

	h, err := b.Reserve(ctx, "acme", 40+256) // prompt 40 + max_tokens 256
	if err != nil {
		panic(err)
	}
	h.Settle(40 + 180) // the answer took 180 tokens: 76 come back

	_, err = b.Reserve(ctx, "acme", 40+256)
	fmt.Println(status.Code(err), budget.Refused(err))
	fmt.Printf("%+v\n", b.Usage("acme").Spent)
	// Output:
	// ResourceExhausted true
	// 220
}
