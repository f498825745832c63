package main

import (
	"strings"
	"testing"
	"time"
)

// The console's flags refuse a console reachable beyond loopback without TLS (its own or
// an ingress's), and flags that need --console-addr without it.
func TestConsoleFlags(t *testing.T) {
	ok := func(f consoleFlags) consoleFlags {
		if f.sessionTTL == 0 {
			f.sessionTTL = time.Hour
		}
		return f
	}
	for _, c := range []struct {
		f    consoleFlags
		want string // "" for valid
	}{
		{consoleFlags{}, ""},
		{consoleFlags{secretFile: "s"}, "needs --console-addr"},
		{ok(consoleFlags{addr: "127.0.0.1:7709"}), ""},
		{ok(consoleFlags{addr: "localhost:7709"}), ""},
		{ok(consoleFlags{addr: ":7709"}), "not a loopback address"},
		{ok(consoleFlags{addr: "10.0.0.5:7709"}), "not a loopback address"},
		{ok(consoleFlags{addr: ":7709", behindTLS: true}), ""},
		{ok(consoleFlags{addr: ":7709", cert: "c", key: "k"}), ""},
		{ok(consoleFlags{addr: ":7709", cert: "c"}), "go together"},
		{ok(consoleFlags{addr: ":7709", cert: "c", key: "k", behindTLS: true}), "not both"},
		{consoleFlags{addr: "127.0.0.1:7709", sessionTTL: time.Second}, "at least 1m"},
	} {
		err := c.f.validate()
		if (c.want == "") != (err == nil) || (err != nil && !strings.Contains(err.Error(), c.want)) {
			t.Errorf("%+v: %v, want %q", c.f, err, c.want)
		}
	}
}
