package cli

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strings"
	"time"

	"google.golang.org/protobuf/types/known/durationpb"

	adminv1 "github.com/curfew-mesh/curfew/gen/curfew/admin/v1"
)

const poolUsage = `Usage:
  curfew pool close POOL [--reason R] [--json]
  curfew pool open POOL [--force] [--reason R] [--json]
  curfew pool reopen POOL --when-orphan-delta-zero FOR [--reason R] [--wait D] [--json]

close sheds every new run of the pool (pool_closed, condition operator) on every
orchestrator within its --operator-poll; runs admitted keep running. open lifts the
close; an automatic fail-closed window keeps the overflow pool closed unless --force,
which admits for one fail-closed window whatever its conditions. reopen waits until the
orphan tokens in the ledger have not grown for FOR, reporting as it waits, then opens.
`

func cmdPool(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	sub, args, code, ok := subcommand("pool", poolUsage, []string{"close", "open", "reopen"}, args, stdout, stderr)
	if !ok {
		return code
	}
	fs := newFlags("pool "+sub, stderr)
	var c common
	c.register(fs)
	reason := fs.String("reason", "", "why, for the audit log")
	var force *bool
	var window, wait *time.Duration
	switch sub {
	case "open":
		force = fs.Bool("force", false, "also lift the overflow pool's automatic fail-closed window, for one window's length")
	case "reopen":
		window = fs.Duration("when-orphan-delta-zero", 0, "open once the orphan tokens have not grown for this long (required)")
		wait = fs.Duration("wait", 10*time.Minute, "give up (exit 1, pool still closed) after this long")
	}
	pos, err := parse(fs, args)
	if err != nil {
		return usageErr(stderr, "pool "+sub, err)
	}
	if len(pos) != 1 || pos[0] == "" {
		return usageErr(stderr, "pool "+sub, errors.New("give one POOL"))
	}
	if sub == "reopen" && (*window <= 0 || *wait <= 0) {
		return usageErr(stderr, "pool reopen", errors.New("--when-orphan-delta-zero is required and must be positive, and --wait positive"))
	}
	if sub == "reopen" {
		req := &adminv1.ReopenPoolRequest{Pool: pos[0], Reason: *reason, Window: durationpb.New(*window)}
		return adminCallFor(ctx, &c, stderr, "pool reopen (the pool stays closed)", *wait, func(ctx context.Context, client adminv1.AdminServiceClient) error {
			return reopen(ctx, client, req, c.json, stdout)
		})
	}
	var state *adminv1.PoolState
	if code := adminCall(ctx, &c, stderr, "pool "+sub, func(ctx context.Context, client adminv1.AdminServiceClient) error {
		if sub == "close" {
			resp, err := client.ClosePool(ctx, &adminv1.ClosePoolRequest{Pool: pos[0], Reason: *reason})
			state = resp.GetPool()
			return err
		}
		resp, err := client.OpenPool(ctx, &adminv1.OpenPoolRequest{Pool: pos[0], Reason: *reason, Force: *force})
		state = resp.GetPool()
		return err
	}); code != ExitOK {
		return code
	}
	if c.json {
		printJSON(stdout, state)
		return ExitOK
	}
	fmt.Fprintln(stdout, poolLine(state))
	return ExitOK
}

// reopen streams ReopenPool's reports, one line each, until the one that opened.
func reopen(ctx context.Context, client adminv1.AdminServiceClient, req *adminv1.ReopenPoolRequest, asJSON bool, stdout io.Writer) error {
	stream, err := client.ReopenPool(ctx, req)
	if err != nil {
		return err
	}
	for {
		rep, err := stream.Recv()
		if err != nil {
			return err
		}
		switch {
		case asJSON:
			printJSON(stdout, rep)
		case rep.GetOpened():
			fmt.Fprintf(stdout, "orphan delta zero for %s: opened. %s\n", rep.GetQuietFor().AsDuration().Round(time.Millisecond), poolLine(rep.GetPool()))
		default:
			fmt.Fprintf(stdout, "waiting: orphan delta %d, zero for %s of %s\n", rep.GetOrphanDelta(),
				rep.GetQuietFor().AsDuration().Round(time.Millisecond), req.GetWindow().AsDuration())
		}
		if rep.GetOpened() {
			return nil
		}
	}
}

// poolLine is one pool's state in a line: whether it admits, and why not.
func poolLine(p *adminv1.PoolState) string {
	var why []string
	if p.GetOperatorClosed() {
		w := "closed by " + dash(p.GetOperatorActor())
		if p.GetOperatorReason() != "" {
			w += ": " + p.GetOperatorReason()
		}
		why = append(why, w)
	}
	if len(p.GetAutoConditions()) > 0 {
		w := "failed closed (" + strings.Join(p.GetAutoConditions(), ",") + ") until " + p.GetAutoClosedUntil().AsTime().UTC().Format(time.RFC3339)
		if p.ForcedOpenUntil != nil {
			w += ", forced open until " + p.GetForcedOpenUntil().AsTime().UTC().Format(time.RFC3339)
		}
		why = append(why, w)
	}
	state := "open"
	if p.GetOperatorClosed() || p.GetAutoClosed() {
		state = "closed"
	}
	line := fmt.Sprintf("pool %s %s on %s", p.GetPool(), state, dash(p.GetReplica()))
	if len(why) > 0 {
		line += ": " + strings.Join(why, "; ")
	}
	return line
}
