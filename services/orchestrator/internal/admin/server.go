package admin

import (
	"context"
	"log/slog"
	"time"

	"google.golang.org/grpc"

	adminv1 "github.com/curfew-mesh/curfew/gen/curfew/admin/v1"
	"github.com/curfew-mesh/curfew/mesh/admission"
	"github.com/curfew-mesh/curfew/mesh/breaker"
	"github.com/curfew-mesh/curfew/mesh/retrywindow"
	"github.com/curfew-mesh/curfew/mesh/store"
)

// Config is what the admin server works with. Store is required; the rest is optional,
// and a status section whose source is nil is left empty.
type Config struct {
	// Store is the shared store every replica reads the operators' state from.
	Store store.Store
	// Replica names this orchestrator (its owner name) in answers.
	Replica string
	// Pools is this replica's admission controller, seen by operators (PoolControls);
	// nil when admission is off, and then the pool methods answer FAILED_PRECONDITION.
	Pools Pools
	// Breakers are this orchestrator's breakers, shown by Status; nil: none shown.
	Breakers *breaker.Set
	// RetryWindows holds this orchestrator's coordinated retry windows, shown by Status
	// (service.Runtime.RetryWindows); nil: retries are not coordinated, none shown.
	RetryWindows *retrywindow.Holder
	// ReopenPoll is how often ReopenPool reads the orphan delta and reports (0: 1 s,
	// or a quarter of the window when that is shorter).
	ReopenPoll time.Duration
	// Decoders reaches every modelproxy replica, for the decoder leases (leases.go);
	// nil: no replica is known, and the lease methods find no lease.
	Decoders Decoders
	// Log receives what the server does beyond its answers; nil: slog.Default().
	Log *slog.Logger
	// Tenants says a tenant's settings (the admission configuration's, which reloads):
	// DecideApproval reads TenantLimits.ApproverNotStarter. nil: no tenant requires it.
	Tenants Tenants
}

// Tenants is where a tenant's settings are read.
type Tenants interface {
	TenantLimits(tenant string) admission.TenantLimits
}

// Pools is the admission side the rollback order acts on, as this replica sees it.
type Pools interface {
	// PoolStates returns every configured pool's live state on this replica (in
	// flight, queued, the automatic fail-closed window) merged with the operators'
	// controls it last read from the store.
	PoolStates() []*adminv1.PoolState
	// Pool reports whether pool is configured.
	Pool(name string) bool
	// Refresh reads the operators' controls from the store and applies them on this
	// replica now, rather than at the next poll.
	Refresh(ctx context.Context) error
	// FailClosedWindow is the automatic fail-closed window: how long an open with
	// force admits despite it.
	FailClosedWindow() time.Duration
}

// Server implements adminv1.AdminServiceServer. Methods whose feature has not been
// built answer UNIMPLEMENTED.
type Server struct {
	adminv1.UnimplementedAdminServiceServer
	cfg Config
}

// New returns the admin server of cfg.
func New(cfg Config) *Server {
	if cfg.Log == nil {
		cfg.Log = slog.Default()
	}
	return &Server{cfg: cfg}
}

// Register serves s on r.
func (s *Server) Register(r grpc.ServiceRegistrar) { adminv1.RegisterAdminServiceServer(r, s) }

var _ adminv1.AdminServiceServer = (*Server)(nil)
