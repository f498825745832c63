// Command curfew-mcptest serves the test MCP server of internal/mcptest over stdio (the
// default) or streamable HTTP.
//
//	curfew-mcptest [--http ADDR] [--record FILE]
//
// --http ADDR serves streamable HTTP at http://ADDR/ instead of stdio and prints
// "listening on ADDR" to stderr once it accepts connections. --record FILE appends one
// JSON line per call (mcptest.Record).
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/modelcontextprotocol/go-sdk/mcp"

	"github.com/curfew-mesh/curfew/internal/mcptest"
)

func main() {
	addr := flag.String("http", "", "serve streamable HTTP on this address instead of stdio")
	record := flag.String("record", "", "append one JSON line per call to this file")
	flag.Parse()
	if err := run(*addr, *record); err != nil {
		fmt.Fprintln(os.Stderr, "curfew-mcptest:", err)
		os.Exit(1)
	}
}

func run(addr, record string) error {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	var rec *mcptest.Recorder
	if record != "" {
		f, err := os.OpenFile(record, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600) //nolint:gosec // --record names the file
		if err != nil {
			return fmt.Errorf("--record: %w", err)
		}
		defer f.Close()
		rec = mcptest.NewRecorder(f)
	}
	server := mcptest.NewServer(rec)
	if addr == "" {
		err := server.Run(ctx, &mcp.StdioTransport{})
		if ctx.Err() != nil {
			return nil
		}
		return err
	}
	ln, err := new(net.ListenConfig).Listen(ctx, "tcp", addr)
	if err != nil {
		return fmt.Errorf("--http: %w", err)
	}
	handler := mcp.NewStreamableHTTPHandler(func(*http.Request) *mcp.Server { return server }, nil)
	hs := &http.Server{Handler: handler, ReadHeaderTimeout: 10 * time.Second}
	fmt.Fprintln(os.Stderr, "listening on", ln.Addr())
	errc := make(chan error, 1)
	go func() { errc <- hs.Serve(ln) }()
	select {
	case err := <-errc:
		return err
	case <-ctx.Done():
	}
	sctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	if err := hs.Shutdown(sctx); err != nil && !errors.Is(err, context.DeadlineExceeded) {
		return err
	}
	return nil
}
