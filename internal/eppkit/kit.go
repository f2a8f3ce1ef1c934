// Package eppkit is a black-box conformance kit for Endpoint Pickers (the Gateway API
// Inference Extension's Endpoint Picker Protocol, v1.0.0, over Envoy's ext_proc v3): it plays a
// data plane against any picker's gRPC address and checks what the protocol says a picker does
// — the destination header and its envoy.lb metadata agreeing, the fallback list's format, the
// subset hint, each request body mode, bodies in pieces and handed back unchanged, the response
// path, immediate responses, the health services, malformed and out-of-order messages. It knows
// nothing of the picker behind the address: `baton epp-conformance --target HOST:PORT` runs it
// against Baton's picker or any other.
package eppkit

import (
	"bytes"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/baton-llm/baton/internal/epp"
	"github.com/baton-llm/baton/internal/epp/dataplane"
)

// Options say where the picker is and what to ask it.
type Options struct {
	Target string // the ext_proc address, HOST:PORT
	Health string // the gRPC health address; "" is Target
	TLS    bool   // speak TLS to Target (the certificate is not verified: a kit checks the protocol)
	Model  string // a model the picker's endpoints serve
	Path   string // the inference path the requests go to (default /v1/completions)
	// Timeout bounds one case (default 10 s).
	Timeout time.Duration
}

// Result is one case's outcome.
type Result struct {
	Name, Spec string // the case, and what of the protocol it checks
	Pass       bool
	Detail     string // why it failed ("" when it passed)
	Took       time.Duration
}

// Kit holds the connections to the picker under test.
type Kit struct {
	o      Options
	conn   *grpc.ClientConn
	health *grpc.ClientConn
	client extprocv3.ExternalProcessorClient
}

// Dial connects to the picker (and its health address).
func Dial(o Options) (*Kit, error) {
	if o.Path == "" {
		o.Path = "/v1/completions"
	}
	if o.Timeout <= 0 {
		o.Timeout = 10 * time.Second
	}
	if o.Model == "" {
		return nil, errors.New("a model the picker's endpoints serve is needed (--model)")
	}
	creds := insecure.NewCredentials()
	if o.TLS {
		creds = credentials.NewTLS(&tls.Config{InsecureSkipVerify: true}) //nolint:gosec // a protocol check, not a trust decision
	}
	conn, err := grpc.NewClient(o.Target, grpc.WithTransportCredentials(creds), grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(64<<20)))
	if err != nil {
		return nil, err
	}
	k := &Kit{o: o, conn: conn, health: conn, client: extprocv3.NewExternalProcessorClient(conn)}
	if o.Health != "" && o.Health != o.Target {
		if k.health, err = grpc.NewClient(o.Health, grpc.WithTransportCredentials(insecure.NewCredentials())); err != nil {
			conn.Close()
			return nil, err
		}
	}
	return k, nil
}

// Close closes the connections.
func (k *Kit) Close() {
	k.conn.Close()
	if k.health != k.conn {
		k.health.Close()
	}
}

// A check is one case.
type check struct {
	name, spec string
	run        func(ctx context.Context, k *Kit) error
}

// Run runs every case, in order, and returns their results.
func (k *Kit) Run(ctx context.Context) []Result {
	var out []Result
	for _, c := range cases {
		cctx, cancel := context.WithTimeout(ctx, k.o.Timeout)
		start := time.Now()
		err := safeRun(cctx, k, c.run)
		cancel()
		r := Result{Name: c.name, Spec: c.spec, Pass: err == nil, Took: time.Since(start)}
		if err != nil {
			r.Detail = err.Error()
		}
		out = append(out, r)
	}
	return out
}

// Cases is the number of cases the kit runs.
func Cases() int { return len(cases) }

func safeRun(ctx context.Context, k *Kit, f func(context.Context, *Kit) error) (err error) {
	defer func() {
		if v := recover(); v != nil {
			err = fmt.Errorf("the kit failed on the answer: %v", v)
		}
	}()
	return f(ctx, k)
}

// --- the exchanges ---

func (k *Kit) body(prompt string) []byte {
	return fmt.Appendf(nil, `{"model":%q,"prompt":%q,"max_tokens":4}`, k.o.Model, prompt)
}

// headers is a request's headers as Envoy sends them (dataplane's), with a JSON content type.
func headers(method, path string, extra http.Header, eos bool) *extprocv3.ProcessingRequest {
	h := http.Header{"Content-Type": {"application/json"}}
	for k, vs := range extra {
		h[k] = vs
	}
	return dataplane.RequestHeaders(method, "gateway.example", path, h, eos)
}

func withMode(m *extprocv3.ProcessingRequest, mode filterv3.ProcessingMode_BodySendMode) *extprocv3.ProcessingRequest {
	m.ProtocolConfig = &extprocv3.ProtocolConfiguration{RequestBodyMode: mode, ResponseBodyMode: filterv3.ProcessingMode_FULL_DUPLEX_STREAMED}
	return m
}

func withSubset(m *extprocv3.ProcessingRequest, subset *structpb.Value) *extprocv3.ProcessingRequest {
	m.MetadataContext = &corev3.Metadata{FilterMetadata: map[string]*structpb.Struct{epp.SubsetNamespace: {Fields: map[string]*structpb.Value{epp.SubsetKey: subset}}}}
	return m
}

func list(eps ...string) *structpb.Value {
	vals := make([]*structpb.Value, len(eps))
	for i, e := range eps {
		vals[i] = structpb.NewStringValue(e)
	}
	return structpb.NewListValue(&structpb.ListValue{Values: vals})
}

// pick is what the answer to the request's headers said.
type pick struct {
	header, metadata string
	mutation         *extprocv3.HeaderMutation
	immediate        *extprocv3.ImmediateResponse
}

func (p pick) endpoints() []string { return strings.Split(p.header, ",") }

func readPick(m *extprocv3.ProcessingResponse) (pick, error) {
	if ir := m.GetImmediateResponse(); ir != nil {
		return pick{immediate: ir}, nil
	}
	var c *extprocv3.CommonResponse
	switch {
	case m.GetRequestHeaders() != nil:
		c = m.GetRequestHeaders().GetResponse()
	case m.GetRequestBody() != nil:
		c = m.GetRequestBody().GetResponse()
	default:
		return pick{}, fmt.Errorf("the request path's answer is a %T, not headers, body or an immediate response", m.Response)
	}
	p := pick{mutation: c.GetHeaderMutation()}
	for _, h := range p.mutation.GetSetHeaders() {
		if strings.EqualFold(h.GetHeader().GetKey(), epp.HeaderDestination) {
			p.header = string(h.GetHeader().GetRawValue())
			if p.header == "" {
				p.header = h.GetHeader().GetValue()
			}
		}
	}
	p.metadata = m.GetDynamicMetadata().GetFields()[epp.MetadataNamespace].GetStructValue().GetFields()[epp.HeaderDestination].GetStringValue()
	return p, nil
}

// exchange sends the headers and body of one request in full duplex and reads the pick, and
// the body handed back (its bytes).
func (k *Kit) exchange(ctx context.Context, first *extprocv3.ProcessingRequest, chunks ...[]byte) (extprocv3.ExternalProcessor_ProcessClient, pick, []byte, error) {
	st, err := k.client.Process(ctx)
	if err != nil {
		return nil, pick{}, nil, err
	}
	if err := st.Send(first); err != nil {
		return st, pick{}, nil, err
	}
	for i, c := range chunks {
		m := dataplane.RequestBody(c, i == len(chunks)-1)
		m.MetadataContext = first.MetadataContext // Envoy forwards the metadata with every message
		if err := st.Send(m); err != nil {
			return st, pick{}, nil, err
		}
	}
	m, err := st.Recv()
	if err != nil {
		return st, pick{}, nil, fmt.Errorf("no answer to the request: %w", err)
	}
	p, err := readPick(m)
	if err != nil || p.immediate != nil || len(chunks) == 0 {
		return st, p, nil, err
	}
	var back bytes.Buffer
	for {
		m, err := st.Recv()
		if err != nil {
			return st, p, back.Bytes(), fmt.Errorf("the body handed back: %w", err)
		}
		sr := m.GetRequestBody().GetResponse().GetBodyMutation().GetStreamedResponse()
		if sr == nil {
			return st, p, back.Bytes(), fmt.Errorf("the body handed back: a %T, not a streamed body", m.Response)
		}
		back.Write(sr.GetBody())
		if sr.GetEndOfStream() {
			return st, p, back.Bytes(), nil
		}
	}
}

// picked runs a whole full-duplex request to its pick and ends the stream.
func (k *Kit) picked(ctx context.Context, first *extprocv3.ProcessingRequest, body []byte) (pick, []byte, error) {
	st, p, back, err := k.exchange(ctx, withMode(first, filterv3.ProcessingMode_FULL_DUPLEX_STREAMED), body)
	if st != nil {
		_ = st.CloseSend()
	}
	return p, back, err
}

func validEndpoint(e string) error {
	host, port, err := net.SplitHostPort(e)
	if err != nil || host == "" {
		return fmt.Errorf("%q is no ip:port", e)
	}
	if n, err := strconv.Atoi(port); err != nil || n < 1 || n > 65535 {
		return fmt.Errorf("%q: port out of range", e)
	}
	return nil
}

func wantPick(p pick) error {
	switch {
	case p.immediate != nil:
		return fmt.Errorf("an immediate response %d (%s) instead of a pick", p.immediate.GetStatus().GetCode(), p.immediate.GetBody())
	case p.header == "":
		return errors.New("no " + epp.HeaderDestination + " header set")
	}
	return nil
}

func wantImmediate(p pick, err error, codes ...int) error {
	if err != nil {
		return err
	}
	if p.immediate == nil {
		return fmt.Errorf("a pick (%q) instead of an immediate response %v", p.header, codes)
	}
	if c := int(p.immediate.GetStatus().GetCode()); !slices.Contains(codes, c) {
		return fmt.Errorf("immediate response %d, want %v", c, codes)
	}
	return nil
}

// wantStreamError expects the picker to end a stream with an error (or close it) after a
// protocol violation, rather than answer as if nothing were wrong.
func wantStreamError(st extprocv3.ExternalProcessor_ProcessClient) error {
	for i := 0; i < 4; i++ {
		m, err := st.Recv()
		if err != nil {
			return nil // ended: with an error status, or closed
		}
		if m.GetImmediateResponse() != nil {
			return nil // refusing the request is also an answer to a broken exchange
		}
	}
	return errors.New("the picker went on answering an exchange that broke the protocol")
}
