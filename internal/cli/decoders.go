package cli

import (
	"context"
	"errors"
	"fmt"
	"io"
	"text/tabwriter"
	"time"

	"google.golang.org/protobuf/types/known/durationpb"

	adminv1 "github.com/curfew-mesh/curfew/gen/curfew/admin/v1"
)

// The decoder side of seed 003's rollback order, through the admin API
// (docs/operations.md, "Leases, the ledger and decoders"): decoder leases on every
// modelproxy replica, ledger freezes and decoder drains.

const leasesUsage = `Usage:
  curfew leases ls     [--older-than D] [--json]
  curfew leases cancel --older-than D [--reason R] [--json]

Decoder leases live in each modelproxy replica's memory; the orchestrator asks every
replica. ls lists the decoders running (oldest first: replica, tenant, run, node, model,
provider, age, last heartbeat, tokens so far), of every replica, naming those that did
not answer. cancel ends the decoders started longer ago than --older-than (required:
give 1ms for every one) with cause operator.
`

const ledgerUsage = `Usage:
  curfew ledger freeze (--run ID [--tenant T] | --tenant T) [--reason R] [--json]
  curfew ledger thaw   (--run ID [--tenant T] | --tenant T) [--reason R] [--json]
  curfew ledger ls     [--json]

freeze stops the decoders of a run (or of every run of a tenant) on every modelproxy
replica within a second, with cause operator, and starts no new one for it: its model
calls fail FAILED_PRECONDITION (LEDGER_FROZEN). A run named without --tenant is found
in whichever tenant has it. ls shows, per freeze, the tokens the ledger recorded for
it after the freeze (a decoder's tokens are recorded when it ends, so those running at
the freeze count): once they have stopped, the figure must stop growing. thaw lifts it.
`

const decodersUsage = `Usage:
  curfew decoders drain   [--pool P] [--cancel-after D] [--reason R] [--json]
  curfew decoders undrain [--pool P] [--reason R] [--json]

drain stops admitting new decoders for the runs of pool P (every run without --pool) on
every modelproxy replica within a second: their model calls fail FAILED_PRECONDITION
(DECODERS_DRAINED). The running ones go on; with --cancel-after, those still running
after it are cancelled with cause operator. undrain admits them again (a drain of every
run and a pool's drain are lifted separately).
`

func cmdLeases(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	sub, args, code, ok := subcommand("leases", leasesUsage, []string{"ls", "cancel"}, args, stdout, stderr)
	if !ok {
		return code
	}
	name := "leases " + sub
	fs := newFlags(name, stderr)
	var c common
	c.register(fs)
	olderFlag := fs.String("older-than", "", "only decoders started longer ago than this (90s, 5m)")
	var reason *string
	if sub == "cancel" {
		reason = fs.String("reason", "", "why, for the audit log")
	}
	pos, err := parse(fs, args)
	if err != nil {
		return usageErr(stderr, name, err)
	}
	if len(pos) != 0 {
		return usageErr(stderr, name, errors.New("takes no arguments"))
	}
	older, err := durationFlag("older-than", *olderFlag)
	if err != nil {
		return usageErr(stderr, name, err)
	}
	if sub == "cancel" && older == nil {
		return usageErr(stderr, name, errors.New("--older-than is required (give 1ms to cancel every decoder)"))
	}
	return adminCall(ctx, &c, stderr, name, func(ctx context.Context, client adminv1.AdminServiceClient) error {
		if sub == "ls" {
			resp, err := client.ListLeases(ctx, &adminv1.ListLeasesRequest{OlderThan: older})
			if err != nil {
				return err
			}
			if c.json {
				printJSON(stdout, resp)
				return nil
			}
			printLeases(stdout, resp.GetLeases())
			printUnreachable(stderr, resp.GetUnreachable())
			return nil
		}
		resp, err := client.CancelLeases(ctx, &adminv1.CancelLeasesRequest{OlderThan: older, Reason: *reason})
		if err != nil {
			return err
		}
		if c.json {
			printJSON(stdout, resp)
			return nil
		}
		fmt.Fprintf(stdout, "cancelled %d decoders (cause operator)\n", len(resp.GetCancelled()))
		if len(resp.GetCancelled()) > 0 {
			printLeases(stdout, resp.GetCancelled())
		}
		printUnreachable(stderr, resp.GetUnreachable())
		return nil
	})
}

func printLeases(w io.Writer, ls []*adminv1.Lease) {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "REPLICA\tTENANT\tRUN\tNODE\tMODEL\tPROVIDER\tAGE\tHEARTBEAT\tTOKENS")
	for _, l := range ls {
		hb := "-"
		if l.GetLastHeartbeat() != nil {
			hb = time.Since(l.GetLastHeartbeat().AsTime()).Round(100*time.Millisecond).String() + " ago"
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%d\n", l.GetReplica(), l.GetTenant(), dash(l.GetRunId()), dash(l.GetNodeId()),
			dash(l.GetModel()), dash(l.GetProvider()), l.GetAge().AsDuration().Round(100*time.Millisecond), hb, l.GetTokens())
	}
	_ = tw.Flush()
}

// printUnreachable names, on stderr, the replicas that did not answer a fan-out.
func printUnreachable(w io.Writer, unreachable []string) {
	for _, u := range unreachable {
		fmt.Fprintf(w, "curfew: unreachable: %s\n", u)
	}
}

func cmdLedger(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	sub, args, code, ok := subcommand("ledger", ledgerUsage, []string{"freeze", "thaw", "ls"}, args, stdout, stderr)
	if !ok {
		return code
	}
	name := "ledger " + sub
	fs := newFlags(name, stderr)
	var c common
	c.register(fs)
	var run, tenant, reason *string
	if sub != "ls" {
		run = fs.String("run", "", "the run to "+sub)
		tenant = fs.String("tenant", "", "the run's tenant, or alone: every run of this tenant")
		reason = fs.String("reason", "", "why, for the audit log")
	}
	pos, err := parse(fs, args)
	if err != nil {
		return usageErr(stderr, name, err)
	}
	if len(pos) != 0 {
		return usageErr(stderr, name, errors.New("takes no arguments"))
	}
	if sub != "ls" && *run == "" && *tenant == "" {
		return usageErr(stderr, name, errors.New("give --run ID (with --tenant T when the run id is not unique) or --tenant T"))
	}
	return adminCall(ctx, &c, stderr, name, func(ctx context.Context, client adminv1.AdminServiceClient) error {
		switch sub {
		case "freeze":
			resp, err := client.FreezeLedger(ctx, &adminv1.FreezeLedgerRequest{RunId: *run, Tenant: *tenant, Reason: *reason})
			if err != nil {
				return err
			}
			if c.json {
				printJSON(stdout, resp)
				return nil
			}
			f := resp.GetFreeze()
			fmt.Fprintf(stdout, "frozen: %s since %s; tokens after the freeze: %d\n", freezeName(f), f.GetFrozenAt().AsTime().UTC().Format(time.RFC3339), f.GetTokensAfterFreeze())
		case "thaw":
			resp, err := client.ThawLedger(ctx, &adminv1.ThawLedgerRequest{RunId: *run, Tenant: *tenant, Reason: *reason})
			if err != nil {
				return err
			}
			if c.json {
				printJSON(stdout, resp)
				return nil
			}
			if resp.GetThawed() {
				fmt.Fprintln(stdout, "thawed")
			} else {
				fmt.Fprintln(stdout, "was not frozen")
			}
		default:
			resp, err := client.ListFreezes(ctx, &adminv1.ListFreezesRequest{})
			if err != nil {
				return err
			}
			if c.json {
				printJSON(stdout, resp)
				return nil
			}
			tw := tabwriter.NewWriter(stdout, 0, 4, 2, ' ', 0)
			fmt.Fprintln(tw, "SCOPE\tTENANT\tRUN\tFROZEN_AT\tACTOR\tTOKENS_AFTER\tREASON")
			for _, f := range resp.GetFreezes() {
				scope := "tenant"
				if f.GetRunId() != "" {
					scope = "run"
				}
				fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%d\t%s\n", scope, f.GetTenant(), dash(f.GetRunId()), f.GetFrozenAt().AsTime().UTC().Format(time.RFC3339),
					f.GetActor(), f.GetTokensAfterFreeze(), dash(f.GetReason()))
			}
			_ = tw.Flush()
		}
		return nil
	})
}

func freezeName(f *adminv1.Freeze) string {
	if f.GetRunId() != "" {
		return "run " + f.GetRunId() + " of tenant " + f.GetTenant()
	}
	return "tenant " + f.GetTenant()
}

func cmdDecoders(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	sub, args, code, ok := subcommand("decoders", decodersUsage, []string{"drain", "undrain"}, args, stdout, stderr)
	if !ok {
		return code
	}
	name := "decoders " + sub
	fs := newFlags(name, stderr)
	var c common
	c.register(fs)
	pool := fs.String("pool", "", "only the runs of this admission pool (default: every run)")
	reason := fs.String("reason", "", "why, for the audit log")
	var after *string
	if sub == "drain" {
		after = fs.String("cancel-after", "", "cancel the decoders still running after this long, with cause operator (default: let them end)")
	}
	pos, err := parse(fs, args)
	if err != nil {
		return usageErr(stderr, name, err)
	}
	if len(pos) != 0 {
		return usageErr(stderr, name, errors.New("takes no arguments"))
	}
	var cancelAfter *durationpb.Duration
	if after != nil {
		if cancelAfter, err = durationFlag("cancel-after", *after); err != nil {
			return usageErr(stderr, name, err)
		}
	}
	scope := "every run"
	if *pool != "" {
		scope = "pool " + *pool
	}
	return adminCall(ctx, &c, stderr, name, func(ctx context.Context, client adminv1.AdminServiceClient) error {
		if sub == "drain" {
			resp, err := client.DrainDecoders(ctx, &adminv1.DrainDecodersRequest{Pool: *pool, CancelAfter: cancelAfter, Reason: *reason})
			if err != nil {
				return err
			}
			if c.json {
				printJSON(stdout, resp)
				return nil
			}
			d := resp.GetDrain()
			line := fmt.Sprintf("drained: no new decoder for %s since %s", scope, d.GetStartedAt().AsTime().UTC().Format(time.RFC3339))
			if d.GetCancelAt() != nil {
				line += "; running ones cancelled at " + d.GetCancelAt().AsTime().UTC().Format(time.RFC3339)
			}
			fmt.Fprintln(stdout, line)
			return nil
		}
		resp, err := client.UndrainDecoders(ctx, &adminv1.UndrainDecodersRequest{Pool: *pool, Reason: *reason})
		if err != nil {
			return err
		}
		if c.json {
			printJSON(stdout, resp)
			return nil
		}
		if resp.GetUndrained() {
			fmt.Fprintln(stdout, "undrained: decoders start again for "+scope)
		} else {
			fmt.Fprintln(stdout, "was not drained: "+scope)
		}
		return nil
	})
}
