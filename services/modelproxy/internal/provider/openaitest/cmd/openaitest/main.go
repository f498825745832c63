// Command openaitest runs the openaitest server standalone, for tests over real
// processes: it prints the API base URL (ending in /v1) on the first line of stdout and
// serves until SIGINT or SIGTERM. Replies are scripted with -replies (a JSON array of
// openaitest.Reply, used one per request) and at run time through the control API
// (POST /_openaitest/replies, GET /_openaitest/calls); requests past the script get
// openaitest.DefaultReply.
//
//	openaitest -addr 127.0.0.1:0 -replies replies.json
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"net"
	"os"
	"os/signal"
	"syscall"

	"github.com/curfew-mesh/curfew/services/modelproxy/internal/provider/openaitest"
)

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "openaitest:", err)
		os.Exit(1)
	}
}

func run() error {
	addr := flag.String("addr", "127.0.0.1:0", "listen address")
	repliesFile := flag.String("replies", "", "JSON array of replies, used one per request")
	apiKey := flag.String("api-key", "", "refuse (401) chat requests without Authorization: Bearer <this key>; empty accepts any")
	flag.Parse()
	var replies []openaitest.Reply
	if *repliesFile != "" {
		b, err := os.ReadFile(*repliesFile)
		if err != nil {
			return err
		}
		if err := json.Unmarshal(b, &replies); err != nil {
			return fmt.Errorf("%s: %w", *repliesFile, err)
		}
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	l, err := (&net.ListenConfig{}).Listen(ctx, "tcp", *addr)
	if err != nil {
		return err
	}
	s := openaitest.Serve(l)
	defer s.Close()
	s.Enqueue(replies...)
	s.RequireAPIKey(*apiKey)
	fmt.Println(s.URL())
	<-ctx.Done()
	return nil
}
