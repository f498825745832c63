package client_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log"
	"time"

	"github.com/curfew-mesh/curfew/client"
)

// A plan for the default sim model: think, then answer (docs/plan.md).
const plan = `{"steps": [{"think_tokens": 40}, {"answer_tokens": 5}]}`

// Run a task to its end under a deadline and read its summary.
func ExampleClient_RunAndWait() {
	c, err := client.New(orchestratorAddr, client.WithInsecure(), client.WithAPIKey(apiKey))
	if err != nil {
		log.Fatal(err)
	}
	defer func() { _ = c.Close() }()

	ctx, cancel := context.WithTimeout(context.Background(), time.Minute) // the run's deadline
	defer cancel()
	run, err := c.RunAndWait(ctx, client.Request{Task: plan})
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println(run.GetStatus())
	// Output: RUN_STATUS_SUCCEEDED
}

// Stream a run's events as they happen.
func ExampleClient_Run() {
	c, err := client.New(orchestratorAddr, client.WithInsecure(), client.WithAPIKey(apiKey))
	if err != nil {
		log.Fatal(err)
	}
	defer func() { _ = c.Close() }()

	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	s, err := c.Run(ctx, client.Request{Task: plan})
	if err != nil {
		log.Fatal(err)
	}
	defer s.Close()
	for {
		ev, err := s.Next()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			log.Fatal(err)
		}
		switch ev.Kind {
		case client.EventStarted:
			fmt.Println("started")
		case client.EventFinished:
			fmt.Println("finished:", ev.Finished.GetStatus())
		}
	}
	// Output:
	// started
	// finished: RUN_STATUS_SUCCEEDED
}

// Start a detached run idempotently: the same key returns the same run, started once.
func ExampleClient_Start() {
	c, err := client.New(orchestratorAddr, client.WithInsecure(), client.WithAPIKey(apiKey))
	if err != nil {
		log.Fatal(err)
	}
	defer func() { _ = c.Close() }()

	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	req := client.Request{Task: plan, Timeout: time.Minute}
	key := fmt.Sprintf("example-start-%d", time.Now().UnixNano()) // your job's own id
	first, created, err := c.Start(ctx, req, key)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("created:", created)
	again, created, err := c.Start(ctx, req, key)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("created:", created, "same run:", again.GetRunId() == first.GetRunId())

	s, err := c.Watch(ctx, first.GetRunId())
	if err != nil {
		log.Fatal(err)
	}
	defer s.Close()
	for {
		if _, err := s.Next(); err != nil {
			break
		}
	}
	fmt.Println(s.Summary().GetStatus())
	// Output:
	// created: true
	// created: false same run: true
	// RUN_STATUS_SUCCEEDED
}

// Cancel a detached run, then page through the tenant's runs.
func ExampleClient_Cancel() {
	c, err := client.New(orchestratorAddr, client.WithInsecure(), client.WithAPIKey(apiKey))
	if err != nil {
		log.Fatal(err)
	}
	defer func() { _ = c.Close() }()

	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	slow := `{"steps": [{"tools": [{"name": "sleep", "args": {"ms": 60000}}]}, {"answer_tokens": 5}]}`
	run, _, err := c.Start(ctx, client.Request{Task: slow, Timeout: 2 * time.Minute}, "")
	if err != nil {
		log.Fatal(err)
	}
	run, err = c.Cancel(ctx, run.GetRunId(), "no longer needed")
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println(run.GetStatus(), run.GetCause())

	for r, err := range c.Runs(ctx, 10) {
		if err != nil {
			log.Fatal(err)
		}
		if r.GetRunId() == run.GetRunId() {
			fmt.Println("listed:", r.GetStatus())
		}
	}
	// Output:
	// RUN_STATUS_CANCELLED CANCEL_CAUSE_OPERATOR
	// listed: RUN_STATUS_CANCELLED
}
