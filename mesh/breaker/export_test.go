package breaker

import "time"

// OpenPeriod exposes Config.openPeriod to tests: the open period for a uniform draw u.
func (c Config) OpenPeriod(u float64) time.Duration { return c.WithDefaults().openPeriod(u) }
