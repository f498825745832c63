package breaker

import "time"

// OpenPeriod exposes Config.openPeriod to tests: the open period for a uniform draw u.
func (c Config) OpenPeriod(u float64) time.Duration { return c.WithDefaults().openPeriod(u) }

// SetRand replaces the jitter's random source of the set's breakers; call it before they
// trip.
func (s *Set) SetRand(f func() float64) { s.rand = f }
