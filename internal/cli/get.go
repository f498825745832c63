package cli

import (
	"context"
	"errors"
	"fmt"
	"io"
	"time"

	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
)

const callTimeout = 30 * time.Second

func cmdGet(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := newFlags("get", stderr)
	var c common
	c.register(fs)
	pos, err := parse(fs, args)
	if err != nil {
		return usageErr(stderr, "get", err)
	}
	if len(pos) != 1 {
		return usageErr(stderr, "get", errors.New("give one RUN id"))
	}
	run, code := c.getRun(ctx, stderr, "get", pos[0])
	if run == nil {
		return code
	}
	if c.json {
		printJSON(stdout, run)
	} else {
		printSummary(stdout, run)
	}
	return ExitOK
}

func cmdLs(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := newFlags("ls", stderr)
	var c common
	c.register(fs)
	limit := fs.Int("limit", 50, "most runs to list, newest first")
	model := fs.String("model", "", "only runs started with this model")
	sinceFlag := fs.String("since", "", "only runs created since this long ago (1h) or this RFC 3339 time")
	untilFlag := fs.String("until", "", "only runs created before this long ago (10m) or this RFC 3339 time")
	pos, err := parse(fs, args)
	if err != nil {
		return usageErr(stderr, "ls", err)
	}
	if len(pos) != 0 || *limit < 1 {
		return usageErr(stderr, "ls", errors.New("takes no arguments, and --limit must be at least 1"))
	}
	since, err := parseWhen("--since", *sinceFlag)
	if err != nil {
		return usageErr(stderr, "ls", err)
	}
	until, err := parseWhen("--until", *untilFlag)
	if err != nil {
		return usageErr(stderr, "ls", err)
	}
	if since != nil && until != nil && since.AsTime().After(until.AsTime()) {
		return usageErr(stderr, "ls", errors.New("--since is after --until"))
	}
	conn, err := c.dial()
	if err != nil {
		return callErr(stderr, "dial", err)
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(ctx, callTimeout)
	defer cancel()
	client := orchestratorv1.NewOrchestratorServiceClient(conn)
	var runs []*orchestratorv1.Run
	token := ""
	for len(runs) < *limit {
		resp, err := client.ListRuns(ctx, &orchestratorv1.ListRunsRequest{PageSize: int32(min(*limit-len(runs), 500)), PageToken: token, //nolint:gosec // at most 500
			Model: *model, CreatedAfter: since, CreatedBefore: until})
		if err != nil {
			return callErr(stderr, "ls", err)
		}
		runs = append(runs, resp.GetRuns()...)
		if token = resp.GetNextPageToken(); token == "" {
			break
		}
	}
	if c.json {
		printJSON(stdout, &orchestratorv1.ListRunsResponse{Runs: runs})
		return ExitOK
	}
	fmt.Fprintf(stdout, "%-36s %-18s %-18s %7s %s\n", "RUN", "STATUS", "CAUSE", "TOKENS", "CREATED")
	for _, r := range runs {
		fmt.Fprintf(stdout, "%-36s %-18s %-18s %7d %s\n", r.GetRunId(), lower(r.GetStatus().String(), "RUN_STATUS_"),
			causeName(r.GetCause()), r.GetTokens(), r.GetCreatedAt().AsTime().Local().Format(time.DateTime))
	}
	return ExitOK
}

func cmdCancel(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := newFlags("cancel", stderr)
	var c common
	c.register(fs)
	reason := fs.String("reason", "", "why, recorded in the orchestrator's log")
	pos, err := parse(fs, args)
	if err != nil {
		return usageErr(stderr, "cancel", err)
	}
	if len(pos) != 1 {
		return usageErr(stderr, "cancel", errors.New("give one RUN id"))
	}
	conn, err := c.dial()
	if err != nil {
		return callErr(stderr, "dial", err)
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(ctx, callTimeout)
	defer cancel()
	resp, err := orchestratorv1.NewOrchestratorServiceClient(conn).CancelRun(ctx, &orchestratorv1.CancelRunRequest{RunId: pos[0], Reason: *reason})
	if err != nil {
		return callErr(stderr, "cancel", err)
	}
	if c.json {
		printJSON(stdout, resp.GetRun())
	} else {
		printSummary(stdout, resp.GetRun())
	}
	return ExitOK
}

// getRun fetches one run for command cmd; on failure it has reported the error and
// returns nil and the exit code.
func (c *common) getRun(ctx context.Context, stderr io.Writer, cmd, id string) (*orchestratorv1.Run, int) {
	conn, err := c.dial()
	if err != nil {
		return nil, callErr(stderr, "dial", err)
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(ctx, callTimeout)
	defer cancel()
	resp, err := orchestratorv1.NewOrchestratorServiceClient(conn).GetRun(ctx, &orchestratorv1.GetRunRequest{RunId: id})
	if err != nil {
		return nil, callErr(stderr, cmd, err)
	}
	return resp.GetRun(), ExitOK
}
