package dnsstub

import (
	"context"
	"fmt"
	"net"
	"net/netip"
	"strconv"

	"golang.org/x/net/dns/dnsmessage"
)

// TTL is the time to live of every answer, in seconds: short, so that a resolver that
// caches asks again soon.
const TTL = 1

// Server is a running name server; Close stops it.
type Server struct {
	pc      net.PacketConn
	records map[dnsmessage.Name][][4]byte
	done    chan struct{}
}

// Start serves records (a name, without the trailing dot, to its IPv4 addresses) until
// Close.
func Start(ctx context.Context, records map[string][]string) (*Server, error) {
	s := &Server{records: map[dnsmessage.Name][][4]byte{}, done: make(chan struct{})}
	for name, ips := range records {
		n, err := dnsmessage.NewName(name + ".")
		if err != nil {
			return nil, fmt.Errorf("dnsstub: name %q: %w", name, err)
		}
		for _, ip := range ips {
			a, err := netip.ParseAddr(ip)
			if err != nil || !a.Is4() {
				return nil, fmt.Errorf("dnsstub: %s: %q is not an IPv4 address", name, ip)
			}
			s.records[n] = append(s.records[n], a.As4())
		}
	}
	pc, err := new(net.ListenConfig).ListenPacket(ctx, "udp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	s.pc = pc
	go s.serve()
	return s, nil
}

// Addr is the server's address (127.0.0.1:port).
func (s *Server) Addr() string { return s.pc.LocalAddr().String() }

// Target is the gRPC target of name's replicas on port through this server:
// dns://<server>/<name>:<port>.
func (s *Server) Target(name string, port int) string {
	return "dns://" + s.Addr() + "/" + net.JoinHostPort(name, strconv.Itoa(port))
}

// Close stops the server and waits for its goroutine.
func (s *Server) Close() error {
	err := s.pc.Close()
	<-s.done
	return err
}

func (s *Server) serve() {
	defer close(s.done)
	buf := make([]byte, 1500)
	for {
		n, from, err := s.pc.ReadFrom(buf)
		if err != nil {
			return // closed
		}
		if out, ok := s.answer(buf[:n]); ok {
			_, _ = s.pc.WriteTo(out, from)
		}
	}
}

// answer is the response to the query in msg, or false for a message it cannot parse.
func (s *Server) answer(msg []byte) ([]byte, bool) {
	var p dnsmessage.Parser
	h, err := p.Start(msg)
	if err != nil {
		return nil, false
	}
	q, err := p.Question()
	if err != nil {
		return nil, false
	}
	resp := dnsmessage.Message{Header: dnsmessage.Header{ID: h.ID, Response: true, Authoritative: true}, Questions: []dnsmessage.Question{q}}
	addrs, known := s.records[q.Name]
	switch {
	case !known:
		resp.RCode = dnsmessage.RCodeNameError
	case q.Type == dnsmessage.TypeA:
		for _, a := range addrs {
			resp.Answers = append(resp.Answers, dnsmessage.Resource{
				Header: dnsmessage.ResourceHeader{Name: q.Name, Type: dnsmessage.TypeA, Class: dnsmessage.ClassINET, TTL: TTL},
				Body:   &dnsmessage.AResource{A: a}})
		}
	}
	out, err := resp.Pack()
	return out, err == nil
}
