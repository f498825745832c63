package apikey

import "time"

// SetClock replaces a's clock, for tests of StaleFor.
func (a *Authenticator) SetClock(now func() time.Time) { a.now = now }
