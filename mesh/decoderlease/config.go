package decoderlease

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"time"
)

// Timing is the decoder configuration file (--decoder-config), JSON:
//
//	{"heartbeat": "4s", "lease_ttl": "12s"}
//
// heartbeat is Options.Period (at least DefaultMinTick; omitted: DefaultPeriod),
// lease_ttl is Options.TTL (omitted or "0s": 3 × heartbeat; else at least the
// heartbeat). A reload applies it with Keeper.SetTiming.
type Timing struct {
	Heartbeat time.Duration
	LeaseTTL  time.Duration
}

// DecodeTiming decodes and validates a decoder configuration file. Unknown fields, a
// duration that is not a string, and data after the document are errors.
func DecodeTiming(b []byte) (Timing, error) {
	var f struct {
		Heartbeat *string `json:"heartbeat"`
		LeaseTTL  *string `json:"lease_ttl"`
	}
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&f); err != nil {
		return Timing{}, fmt.Errorf("decoderlease: decoding config: %w", err)
	}
	if _, err := dec.Token(); !errors.Is(err, io.EOF) {
		return Timing{}, errors.New("decoderlease: decoding config: data after the JSON document")
	}
	t := Timing{Heartbeat: DefaultPeriod}
	for _, d := range []struct {
		name string
		s    *string
		to   *time.Duration
	}{{"heartbeat", f.Heartbeat, &t.Heartbeat}, {"lease_ttl", f.LeaseTTL, &t.LeaseTTL}} {
		if d.s == nil {
			continue
		}
		v, err := time.ParseDuration(*d.s)
		if err != nil {
			return Timing{}, fmt.Errorf("decoderlease: %s: %w", d.name, err)
		}
		*d.to = v
	}
	if t.LeaseTTL == 0 {
		t.LeaseTTL = 3 * t.Heartbeat
	}
	switch {
	case t.Heartbeat < DefaultMinTick:
		return Timing{}, fmt.Errorf("decoderlease: heartbeat %v: must be at least %v", t.Heartbeat, DefaultMinTick)
	case t.LeaseTTL < t.Heartbeat:
		return Timing{}, fmt.Errorf("decoderlease: lease_ttl %v: must be at least the heartbeat %v (or 0: 3 × heartbeat)", t.LeaseTTL, t.Heartbeat)
	}
	return t, nil
}
