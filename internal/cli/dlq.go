package cli

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
)

const dlqUsage = `Usage:
  curfew dlq ls      [--run RUN] [--all] [--limit N] [--json]
  curfew dlq show    ID [--json]
  curfew dlq replay  ID [--timeout D] [--json]
  curfew dlq purge   (--id ID | --before TIME | --replayed) [--json]

Dead letters are runs that failed for good, kept for an operator (docs/deadletters.md).
ls lists the open ones, newest first (--all: also those already replayed). replay starts
a dead letter's payload as a new run, once however often it is asked. purge deletes the
dead letters matching every selector given: --before takes an RFC 3339 time or an age
(90m, 72h, 7d). Every call sees only the caller's tenant: curfew calls as "default".
`

// dlqNow is the clock of the AGE column, for tests.
var dlqNow = time.Now

// maxDeadLetterPage is the service's largest page.
const maxDeadLetterPage = 1000

func cmdDlq(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	if len(args) == 0 {
		return usageErr(stderr, "dlq", errors.New("give a subcommand: ls, show, replay or purge\n\n"+strings.TrimSuffix(dlqUsage, "\n")))
	}
	switch args[0] {
	case "ls":
		return dlqLs(ctx, args[1:], stdout, stderr)
	case "show":
		return dlqShow(ctx, args[1:], stdout, stderr)
	case "replay":
		return dlqReplay(ctx, args[1:], stdout, stderr)
	case "purge":
		return dlqPurge(ctx, args[1:], stdout, stderr)
	case "help", "-h", "--help":
		fmt.Fprint(stdout, dlqUsage)
		return ExitOK
	}
	return usageErr(stderr, "dlq", fmt.Errorf("unknown subcommand %q\n\n%s", args[0], strings.TrimSuffix(dlqUsage, "\n")))
}

// withDLQ dials the orchestrator and makes call with a DeadLetterService client within
// callTimeout. A failed call is reported as what failed; it returns the exit code.
func (c *common) withDLQ(ctx context.Context, stderr io.Writer, what string, call func(context.Context, orchestratorv1.DeadLetterServiceClient) error) int {
	conn, err := c.dial()
	if err != nil {
		return callErr(stderr, "dial", err)
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(ctx, callTimeout)
	defer cancel()
	if err := call(ctx, orchestratorv1.NewDeadLetterServiceClient(conn)); err != nil {
		return callErr(stderr, what, err)
	}
	return ExitOK
}

func dlqLs(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := newFlags("dlq ls", stderr)
	var c common
	c.register(fs)
	run := fs.String("run", "", "only this run's dead letters")
	all := fs.Bool("all", false, "also those already replayed")
	limit := fs.Int("limit", 50, "most dead letters to list, newest first")
	pos, err := parse(fs, args)
	if err != nil {
		return usageErr(stderr, "dlq ls", err)
	}
	if len(pos) != 0 || *limit < 1 {
		return usageErr(stderr, "dlq ls", errors.New("takes no arguments, and --limit must be at least 1"))
	}
	var dls []*orchestratorv1.DeadLetter
	code := c.withDLQ(ctx, stderr, "dlq ls", func(ctx context.Context, client orchestratorv1.DeadLetterServiceClient) error {
		token := ""
		for len(dls) < *limit {
			resp, err := client.ListDeadLetters(ctx, &orchestratorv1.ListDeadLettersRequest{RunId: *run, IncludeReplayed: *all,
				PageSize: int32(min(*limit-len(dls), maxDeadLetterPage)), PageToken: token}) //nolint:gosec // at most maxDeadLetterPage
			if err != nil {
				return err
			}
			dls = append(dls, resp.GetDeadLetters()...)
			if token = resp.GetNextPageToken(); token == "" {
				break
			}
		}
		return nil
	})
	if code != ExitOK {
		return code
	}
	if c.json {
		printJSON(stdout, &orchestratorv1.ListDeadLettersResponse{DeadLetters: dls})
		return ExitOK
	}
	printDeadLetters(stdout, dls, dlqNow())
	return ExitOK
}

func printDeadLetters(w io.Writer, dls []*orchestratorv1.DeadLetter, now time.Time) {
	fmt.Fprintf(w, "%-36s %-36s %-14s %-18s %8s %7s %s\n", "ID", "RUN", "STEP", "ERROR_TYPE", "ATTEMPTS", "AGE", "REPLAYED")
	for _, d := range dls {
		replayed := "-"
		if d.GetReplayedAt() != nil {
			replayed = age(now, d.GetReplayedAt()) + " ago"
		}
		fmt.Fprintf(w, "%-36s %-36s %-14s %-18s %8d %7s %s\n", d.GetId(), d.GetRunId(), d.GetStep(), orDash(d.GetErrorType()),
			d.GetAttempts(), age(now, d.GetCreatedAt()), replayed)
	}
}

func dlqShow(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := newFlags("dlq show", stderr)
	var c common
	c.register(fs)
	pos, err := parse(fs, args)
	if err != nil {
		return usageErr(stderr, "dlq show", err)
	}
	if len(pos) != 1 {
		return usageErr(stderr, "dlq show", errors.New("give one dead letter ID"))
	}
	var d *orchestratorv1.DeadLetter
	code := c.withDLQ(ctx, stderr, "dlq show", func(ctx context.Context, client orchestratorv1.DeadLetterServiceClient) error {
		resp, err := client.GetDeadLetter(ctx, &orchestratorv1.GetDeadLetterRequest{Id: pos[0]})
		d = resp.GetDeadLetter()
		return err
	})
	if code != ExitOK {
		return code
	}
	if c.json {
		printJSON(stdout, d)
	} else {
		printDeadLetter(stdout, d, dlqNow())
	}
	return ExitOK
}

// printDeadLetter prints every field of d, then its payload: as text when it is JSON
// (indented), else in base64.
func printDeadLetter(w io.Writer, d *orchestratorv1.DeadLetter, now time.Time) {
	when := func(ts *timestamppb.Timestamp) string {
		if ts == nil {
			return "-"
		}
		return fmt.Sprintf("%s (%s ago)", ts.AsTime().Local().Format(time.DateTime), age(now, ts))
	}
	for _, f := range [][2]string{
		{"id", d.GetId()},
		{"tenant", d.GetTenant()},
		{"run", d.GetRunId()},
		{"step", d.GetStep()},
		{"error type", orDash(d.GetErrorType())},
		{"attempts", strconv.Itoa(int(d.GetAttempts()))},
		{"last error", orDash(d.GetLastError())},
		{"idempotency key", orDash(d.GetIdempotencyKey())},
		{"created", when(d.GetCreatedAt())},
		{"replayed", when(d.GetReplayedAt())},
		{"replay count", strconv.Itoa(int(d.GetReplayCount()))},
	} {
		fmt.Fprintf(w, "%-16s %s\n", f[0]+":", f[1])
	}
	p := d.GetPayload()
	var ind bytes.Buffer
	switch {
	case len(p) == 0:
		fmt.Fprintf(w, "%-16s -\n", "payload:")
	case utf8.Valid(p) && json.Indent(&ind, p, "", "  ") == nil:
		fmt.Fprintf(w, "payload:\n%s\n", ind.String())
	default:
		fmt.Fprintf(w, "payload (base64, %d bytes):\n%s\n", len(p), base64.StdEncoding.EncodeToString(p))
	}
}

func dlqReplay(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := newFlags("dlq replay", stderr)
	var c common
	c.register(fs)
	timeout := fs.Duration("timeout", 0, "the replay run's time (default: the orchestrator's)")
	pos, err := parse(fs, args)
	if err != nil {
		return usageErr(stderr, "dlq replay", err)
	}
	if len(pos) != 1 {
		return usageErr(stderr, "dlq replay", errors.New("give one dead letter ID"))
	}
	if *timeout < 0 {
		return usageErr(stderr, "dlq replay", errors.New("--timeout must not be negative"))
	}
	req := &orchestratorv1.ReplayDeadLetterRequest{Id: pos[0]}
	if *timeout > 0 {
		req.Timeout = durationpb.New(*timeout)
	}
	var resp *orchestratorv1.ReplayDeadLetterResponse
	code := c.withDLQ(ctx, stderr, "dlq replay", func(ctx context.Context, client orchestratorv1.DeadLetterServiceClient) error {
		var err error
		resp, err = client.ReplayDeadLetter(ctx, req)
		return err
	})
	if code != ExitOK {
		return code
	}
	switch {
	case c.json:
		printJSON(stdout, resp)
	case resp.GetCreated():
		fmt.Fprintf(stdout, "replayed as run %s\n", resp.GetRunId())
	default:
		fmt.Fprintf(stdout, "already replayed as run %s\n", resp.GetRunId())
	}
	return ExitOK
}

func dlqPurge(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := newFlags("dlq purge", stderr)
	var c common
	c.register(fs)
	id := fs.String("id", "", "this dead letter only")
	before := fs.String("before", "", "those created before this RFC 3339 time, or this long ago (90m, 72h, 7d)")
	replayed := fs.Bool("replayed", false, "only those already replayed")
	pos, err := parse(fs, args)
	if err != nil {
		return usageErr(stderr, "dlq purge", err)
	}
	if len(pos) != 0 {
		return usageErr(stderr, "dlq purge", errors.New("takes no arguments: select with --id, --before or --replayed"))
	}
	if *id == "" && *before == "" && !*replayed {
		return usageErr(stderr, "dlq purge", errors.New("give at least one of --id, --before and --replayed"))
	}
	req := &orchestratorv1.PurgeDeadLettersRequest{Id: *id, OnlyReplayed: *replayed}
	if *before != "" {
		t, err := parseBefore(*before, dlqNow())
		if err != nil {
			return usageErr(stderr, "dlq purge", err)
		}
		req.Before = timestamppb.New(t)
	}
	var resp *orchestratorv1.PurgeDeadLettersResponse
	code := c.withDLQ(ctx, stderr, "dlq purge", func(ctx context.Context, client orchestratorv1.DeadLetterServiceClient) error {
		var err error
		resp, err = client.PurgeDeadLetters(ctx, req)
		return err
	})
	if code != ExitOK {
		return code
	}
	if c.json {
		printJSON(stdout, resp)
		return ExitOK
	}
	noun := "dead letters"
	if resp.GetPurged() == 1 {
		noun = "dead letter"
	}
	fmt.Fprintf(stdout, "purged %d %s\n", resp.GetPurged(), noun)
	return ExitOK
}

// parseBefore reads --before: an RFC 3339 time, or a positive age (a Go duration, or a
// whole number of days such as 7d) counted back from now.
func parseBefore(s string, now time.Time) (time.Time, error) {
	if t, err := time.Parse(time.RFC3339Nano, s); err == nil {
		return t, nil
	}
	var d time.Duration
	if days, ok := strings.CutSuffix(s, "d"); ok {
		n, err := strconv.Atoi(days)
		if err != nil || n <= 0 || n > 100*365 {
			return time.Time{}, fmt.Errorf("--before %q: want an RFC 3339 time or an age such as 90m, 72h or 7d", s)
		}
		d = time.Duration(n) * 24 * time.Hour
	} else {
		var err error
		if d, err = time.ParseDuration(s); err != nil || d <= 0 {
			return time.Time{}, fmt.Errorf("--before %q: want an RFC 3339 time or a positive age such as 90m, 72h or 7d", s)
		}
	}
	return now.Add(-d), nil
}

// age is how long before now ts was, in at most two units: 45s, 12m, 3h05m, 4d02h.
func age(now time.Time, ts *timestamppb.Timestamp) string {
	if ts == nil {
		return "-"
	}
	d := max(now.Sub(ts.AsTime()), 0)
	switch {
	case d < time.Minute:
		return fmt.Sprintf("%ds", int(d/time.Second))
	case d < time.Hour:
		return fmt.Sprintf("%dm", int(d/time.Minute))
	case d < 24*time.Hour:
		return fmt.Sprintf("%dh%02dm", int(d/time.Hour), int(d%time.Hour/time.Minute))
	}
	return fmt.Sprintf("%dd%02dh", int(d/(24*time.Hour)), int(d%(24*time.Hour)/time.Hour))
}

func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}
