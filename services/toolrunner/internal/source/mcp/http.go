package mcp

import (
	"context"
	"errors"
	"fmt"
	"io"
	"mime"
	"net/http"
	"net/url"
	"sync"
	"sync/atomic"

	sdk "github.com/modelcontextprotocol/go-sdk/mcp"

	"github.com/curfew-mesh/curfew/services/toolrunner/internal/source"
)

// HTTPConfig is an MCP server reached over streamable HTTP.
type HTTPConfig struct {
	// Name names the source in errors and logs.
	Name string
	// URL is the server's MCP endpoint (http or https).
	URL string
	// Header is sent with every request (authorization, for example); the headers of
	// the protocol itself (Content-Type, Accept, Mcp-Session-Id, ...) win over it.
	Header http.Header
}

// OpenHTTP returns the source of the server at cfg.URL. A malformed URL is an error; a
// server that does not answer leaves the source down (UNAVAILABLE) and reconnecting
// with backoff.
func OpenHTTP(ctx context.Context, cfg HTTPConfig, opts Options) (*Source, error) {
	if cfg.Name == "" {
		return nil, errors.New("mcp: http source: name is empty")
	}
	u, err := url.Parse(cfg.URL)
	if err != nil {
		return nil, fmt.Errorf("mcp source %q: url: %w", cfg.Name, err)
	}
	if (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return nil, fmt.Errorf("mcp source %q: url %q: want http://host/path or https://host/path", cfg.Name, cfg.URL)
	}
	s := newSource(cfg.Name, opts, func(s *Source) func(context.Context) (*session, error) {
		base := http.DefaultTransport.(*http.Transport).Clone()
		s.onClose = base.CloseIdleConnections
		client := &http.Client{Transport: &limitTransport{base: base, header: cfg.Header.Clone(), max: s.opts.MaxMessageBytes}}
		return func(ctx context.Context) (*session, error) { return s.connectHTTP(ctx, cfg, client) }
	})
	s.start(ctx)
	return s, nil
}

func (s *Source) connectHTTP(ctx context.Context, cfg HTTPConfig, client *http.Client) (*session, error) {
	transport := &sdk.StreamableClientTransport{
		Endpoint:   cfg.URL,
		HTTPClient: client,
		// The SDK's own event limit stays as a backstop above ours.
		MaxEventSize: 2*s.opts.MaxMessageBytes + 1<<16,
	}
	cs, err := s.client.Connect(ctx, transport, nil)
	if err != nil {
		return nil, err
	}
	sess := &session{cs: cs, done: make(chan struct{})}
	go func() {
		err := cs.Wait()
		if err == nil {
			err = errors.New("session closed")
		}
		sess.err = err
		close(sess.done)
	}()
	var endOnce sync.Once
	sess.end = func() {
		endOnce.Do(func() { _ = cs.Close() })
		<-sess.done
	}
	return sess, nil
}

// limitTransport adds the configured headers to every request and bounds what is read
// of every response: a JSON body as a whole, an event stream event by event. A response
// over the limit fails to read with an error wrapping source.ErrTooLarge, and marks the
// call whose request it answers (callFlag) so that Call can say so.
type limitTransport struct {
	base   http.RoundTripper
	header http.Header
	max    int
}

func (t *limitTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	if len(t.header) > 0 {
		req = req.Clone(req.Context())
		for k, vs := range t.header {
			if _, set := req.Header[http.CanonicalHeaderKey(k)]; !set {
				req.Header[http.CanonicalHeaderKey(k)] = vs
			}
		}
	}
	resp, err := t.base.RoundTrip(req)
	if err != nil {
		return nil, err
	}
	flag := callFlag(req.Context())
	if flag == nil {
		flag = new(atomic.Bool)
	}
	mt, _, _ := mime.ParseMediaType(resp.Header.Get("Content-Type"))
	resp.Body = &bodyLimit{r: resp.Body, max: t.max, perEvent: mt == "text/event-stream", tooLarge: flag}
	return resp, nil
}

// bodyLimit fails reads past max bytes of a body, or of one event of an event stream
// (events end with a blank line).
type bodyLimit struct {
	r        io.ReadCloser
	max      int
	perEvent bool
	tooLarge *atomic.Bool
	n        int  // bytes of the body, or of the event so far
	nl       bool // the last byte ended a line (for events: a blank line ends one)
	cr       bool // the last byte was '\r'
	err      error
}

func (b *bodyLimit) Read(p []byte) (int, error) {
	if b.err != nil {
		return 0, b.err
	}
	n, err := b.r.Read(p)
	if !b.perEvent {
		b.n += n
	} else {
		for _, c := range p[:n] {
			switch {
			case c == '\n' && b.cr: // the \n of \r\n
				b.cr = false
				continue
			case c == '\n' || c == '\r':
				if b.nl {
					b.n = 0 // a blank line: the event ended
				}
				b.nl, b.cr = true, c == '\r'
				continue
			}
			b.nl, b.cr = false, false
			b.n++
			if b.n > b.max {
				break
			}
		}
	}
	if b.n > b.max {
		b.tooLarge.Store(true)
		b.err = fmt.Errorf("%w: a response of the server is over %d bytes", source.ErrTooLarge, b.max)
		return 0, b.err
	}
	return n, err
}

func (b *bodyLimit) Close() error { return b.r.Close() }
