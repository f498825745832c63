package admin

import (
	"context"
	"fmt"
	"slices"
	"strings"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/descriptorpb"

	adminv1 "github.com/curfew-mesh/curfew/gen/curfew/admin/v1"
	"github.com/curfew-mesh/curfew/mesh/apikey"
	"github.com/curfew-mesh/curfew/mesh/meshtls"
	"github.com/curfew-mesh/curfew/mesh/store"
)

// Prefix is the full-method prefix of every AdminService method.
var Prefix = "/" + adminv1.AdminService_ServiceDesc.ServiceName + "/"

// readOnly holds the full names of the methods that change nothing.
var readOnly = func() map[string]bool {
	m := map[string]bool{}
	sd := adminv1.File_curfew_admin_v1_admin_proto.Services().ByName("AdminService")
	for i := range sd.Methods().Len() {
		md := sd.Methods().Get(i)
		if opts, ok := md.Options().(*descriptorpb.MethodOptions); ok &&
			opts.GetIdempotencyLevel() == descriptorpb.MethodOptions_NO_SIDE_EFFECTS {
			m[Prefix+string(md.Name())] = true
		}
	}
	return m
}()

// ReadOnly reports whether fullMethod is an AdminService method that changes nothing:
// one the read-only scope may call.
func ReadOnly(fullMethod string) bool { return readOnly[fullMethod] }

// Authorizer decides who may call the AdminService.
type Authorizer struct {
	// Keys checks bearer keys; nil (an orchestrator without a shared store) refuses
	// every key, so only the curfew-cli identity may call.
	Keys *apikey.Authenticator
}

// Authorize returns nil when the caller of ctx may call fullMethod (an AdminService
// method), else a status: see the package doc. Other methods are not its business and
// pass.
func (a *Authorizer) Authorize(ctx context.Context, fullMethod string) error {
	if !strings.HasPrefix(fullMethod, Prefix) {
		return nil
	}
	if len(metadata.ValueFromIncomingContext(ctx, apikey.Header)) > 0 {
		if a.Keys == nil {
			return status.Error(codes.Unauthenticated, "this orchestrator keeps no API keys (no shared store); call it as curfew-cli")
		}
		k, err := a.Keys.Key(ctx)
		if err != nil {
			return err
		}
		switch {
		case hasScope(k, store.ScopeAdmin):
			return nil
		case hasScope(k, store.ScopeReadOnly) && ReadOnly(fullMethod):
			return nil
		case hasScope(k, store.ScopeReadOnly):
			return status.Errorf(codes.PermissionDenied, "API key %s has the read-only scope: %s changes something", k.ID, fullMethod)
		}
		return status.Errorf(codes.PermissionDenied, "API key %s (tenant %s) has no operator scope: %s is for operators", k.ID, k.Tenant, fullMethod)
	}
	id, ok := meshtls.PeerIdentity(ctx)
	if !ok {
		return status.Errorf(codes.Unauthenticated, "%s is for operators: call as curfew-cli or with an API key of the admin or read-only scope", fullMethod)
	}
	if id != meshtls.CLI {
		return status.Errorf(codes.PermissionDenied, "%s may not call %s", id, fullMethod)
	}
	return nil
}

func hasScope(k store.APIKey, scope string) bool { return slices.Contains(k.Scopes, scope) }

// must is the error of a request field that is required.
func must(field string) error {
	return status.Errorf(codes.InvalidArgument, "%s is required", field)
}

func invalid(format string, args ...any) error {
	return status.Error(codes.InvalidArgument, fmt.Sprintf(format, args...))
}
