package eppkit

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/baton-llm/baton/internal/epp"
	"github.com/baton-llm/baton/internal/epp/dataplane"
)

const fullDuplex = filterv3.ProcessingMode_FULL_DUPLEX_STREAMED

// cases are the kit's checks, each tied to what the protocol (004-endpoint-picker-protocol,
// v1.0.0, and ext_proc v3) says.
var cases = []check{
	// Health.
	{"health/liveness", "the gRPC health service answers liveness SERVING", healthCase("liveness")},
	{"health/readiness", "the gRPC health service answers readiness SERVING once the picker can pick", healthCase("readiness")},
	{"health/ext_proc", "the gRPC health service answers envoy.service.ext_proc.v3.ExternalProcessor SERVING", healthCase("envoy.service.ext_proc.v3.ExternalProcessor")},

	// The pick.
	{"pick/header", "the pick is the request header x-gateway-destination-endpoint", func(ctx context.Context, k *Kit) error {
		p, _, err := k.picked(ctx, headers(http.MethodPost, k.o.Path, nil, false), k.body("pick header"))
		if err != nil {
			return err
		}
		return wantPick(p)
	}},
	{"pick/metadata-agrees", "the same value is in the dynamic metadata envoy.lb / x-gateway-destination-endpoint", func(ctx context.Context, k *Kit) error {
		p, _, err := k.picked(ctx, headers(http.MethodPost, k.o.Path, nil, false), k.body("metadata"))
		if err == nil {
			err = wantPick(p)
		}
		if err == nil && p.header != p.metadata {
			err = fmt.Errorf("header %q, metadata %q", p.header, p.metadata)
		}
		return err
	}},
	{"pick/format", "each endpoint is ip:port; a fallback list is comma-separated, without repeats", func(ctx context.Context, k *Kit) error {
		p, _, err := k.picked(ctx, headers(http.MethodPost, k.o.Path, nil, false), k.body("format"))
		if err == nil {
			err = wantPick(p)
		}
		if err != nil {
			return err
		}
		seen := map[string]bool{}
		for _, e := range p.endpoints() {
			if err := validEndpoint(e); err != nil {
				return err
			}
			if seen[e] {
				return fmt.Errorf("%q twice in %q", e, p.header)
			}
			seen[e] = true
		}
		return nil
	}},
	{"pick/overwrites", "a client's own x-gateway-destination-endpoint is replaced, never appended to", func(ctx context.Context, k *Kit) error {
		p, _, err := k.picked(ctx, headers(http.MethodPost, k.o.Path, http.Header{epp.HeaderDestination: {"10.255.255.1:1"}}, false), k.body("overwrite"))
		if err == nil {
			err = wantPick(p)
		}
		if err != nil {
			return err
		}
		for _, h := range p.mutation.GetSetHeaders() {
			// ext_proc applies a set header as a replacement unless told to append (the
			// deprecated append field true: pickers still set it) or to keep a value already
			// there (ADD_IF_ABSENT).
			if strings.EqualFold(h.GetHeader().GetKey(), epp.HeaderDestination) && (appends(h) || h.GetAppendAction() == corev3.HeaderValueOption_ADD_IF_ABSENT) {
				return fmt.Errorf("the header is set to append or only if absent (action %v): the client's value would stay", h.GetAppendAction())
			}
		}
		if strings.Contains(p.header, "10.255.255.1:1") {
			return fmt.Errorf("the client's value is in the pick %q", p.header)
		}
		return nil
	}},
	{"pick/after-body", "in full duplex mode the headers are answered once the body has come, not before", func(ctx context.Context, k *Kit) error {
		st, err := k.client.Process(ctx)
		if err != nil {
			return err
		}
		defer st.CloseSend()
		if err := st.Send(withMode(headers(http.MethodPost, k.o.Path, nil, false), fullDuplex)); err != nil {
			return err
		}
		got := make(chan *extprocv3.ProcessingResponse, 1)
		go func() {
			m, _ := st.Recv()
			got <- m
		}()
		select {
		case m := <-got:
			if m != nil && m.GetImmediateResponse() == nil {
				return fmt.Errorf("answered %T before any body came", m.Response)
			}
			return errors.New("the stream ended before the body came")
		case <-time.After(300 * time.Millisecond):
		}
		if err := st.Send(dataplane.RequestBody(k.body("after body"), true)); err != nil {
			return err
		}
		select {
		case m := <-got:
			p, err := readPick(m)
			if err == nil {
				err = wantPick(p)
			}
			return err
		case <-ctx.Done():
			return errors.New("no answer after the body")
		}
	}},
	{"pick/no-body", "a request without a body (headers end the stream) is picked at its headers", func(ctx context.Context, k *Kit) error {
		st, err := k.client.Process(ctx)
		if err != nil {
			return err
		}
		defer st.CloseSend()
		if err := st.Send(withMode(headers(http.MethodGet, "/v1/models", nil, true), fullDuplex)); err != nil {
			return err
		}
		m, err := st.Recv()
		if err != nil {
			return err
		}
		if m.GetImmediateResponse() != nil {
			return nil // a picker may answer a route it does not pick for itself
		}
		if m.GetRequestHeaders() == nil {
			return fmt.Errorf("answered %T", m.Response)
		}
		return nil
	}},

	// Bodies.
	{"body/handed-back", "the body is handed back (streamed body mutation) with its end of stream", func(ctx context.Context, k *Kit) error {
		b := k.body("handed back")
		_, back, err := k.picked(ctx, headers(http.MethodPost, k.o.Path, nil, false), b)
		if err == nil && !bytes.Equal(back, b) {
			err = fmt.Errorf("%d bytes back for %d sent", len(back), len(b))
		}
		return err
	}},
	{"body/pieces", "a body sent in pieces is read whole and handed back whole", func(ctx context.Context, k *Kit) error {
		b := k.body(strings.Repeat("pieces ", 200))
		st, p, back, err := k.exchange(ctx, withMode(headers(http.MethodPost, k.o.Path, nil, false), fullDuplex), b[:7], b[7:100], b[100:])
		if st != nil {
			defer st.CloseSend()
		}
		if err == nil {
			err = wantPick(p)
		}
		if err == nil && !bytes.Equal(back, b) {
			err = fmt.Errorf("%d bytes back for %d sent", len(back), len(b))
		}
		return err
	}},
	{"body/large", "a body larger than one gRPC message (4 MiB) is handed back whole, in messages a peer can receive", func(ctx context.Context, k *Kit) error {
		b := k.body(strings.Repeat("L", 5<<20))
		var chunks [][]byte
		for rest := b; len(rest) > 0; {
			// Sent in chunks of 64 KiB, well above Envoy's 16 KiB: a picker may bound one
			// message far below the body (its share of the memory it holds bodies in).
			n := min(len(rest), 64<<10)
			chunks, rest = append(chunks, rest[:n]), rest[n:]
		}
		st, p, back, err := k.exchange(ctx, withMode(headers(http.MethodPost, k.o.Path, nil, false), fullDuplex), chunks...)
		if st != nil {
			defer st.CloseSend()
		}
		if err == nil && p.immediate != nil && p.immediate.GetStatus().GetCode() == http.StatusRequestEntityTooLarge {
			return nil // a picker's own size limit refuses it, as it may
		}
		if err == nil {
			err = wantPick(p)
		}
		if err == nil && !bytes.Equal(back, b) {
			err = fmt.Errorf("%d bytes back for %d sent", len(back), len(b))
		}
		return err
	}},
	{"body/byte-exact", "fields the picker does not own pass byte for byte (unknown keys, integers past 2^53, unicode)", func(ctx context.Context, k *Kit) error {
		b := fmt.Appendf(nil, `{"model":%q,"prompt":"h\u00e9 \ud83d\ude00 ✓","max_tokens":4,"seed":12345678901234567890,"x_unknown":{"a":[1,2.50,null]}}`, k.o.Model)
		_, back, err := k.picked(ctx, headers(http.MethodPost, k.o.Path, nil, false), b)
		if err == nil && !bytes.Equal(back, b) {
			err = fmt.Errorf("sent %s, handed back %s", b, back)
		}
		return err
	}},

	// The subset hint.
	{"subset/one", "a subset hint of one endpoint: that endpoint is chosen", func(ctx context.Context, k *Kit) error {
		p, _, err := k.picked(ctx, headers(http.MethodPost, k.o.Path, nil, false), k.body("learn"))
		if err == nil {
			err = wantPick(p)
		}
		if err != nil {
			return err
		}
		ep := p.endpoints()[0]
		q, _, err := k.picked(ctx, withSubset(headers(http.MethodPost, k.o.Path, nil, false), list(ep)), k.body("subset one"))
		if err == nil {
			err = wantPick(q)
		}
		if err == nil && q.endpoints()[0] != ep {
			return fmt.Errorf("subset [%s], picked %q", ep, q.header)
		}
		if err == nil && strings.Contains(q.header, ",") {
			for _, e := range q.endpoints() {
				if e != ep {
					return fmt.Errorf("subset [%s], a fallback outside it: %q", ep, q.header)
				}
			}
		}
		return err
	}},
	{"subset/empty", "an empty subset hint is an immediate 503", func(ctx context.Context, k *Kit) error {
		p, _, err := k.picked(ctx, withSubset(headers(http.MethodPost, k.o.Path, nil, false), list()), k.body("subset empty"))
		return wantImmediate(p, err, http.StatusServiceUnavailable)
	}},
	{"subset/unknown", "a subset hint none of whose endpoints the picker knows is an immediate 503", func(ctx context.Context, k *Kit) error {
		p, _, err := k.picked(ctx, withSubset(headers(http.MethodPost, k.o.Path, nil, false), list("10.255.255.254:65000")), k.body("subset unknown"))
		return wantImmediate(p, err, http.StatusServiceUnavailable)
	}},
	{"subset/other-namespace", "metadata outside envoy.lb.subset_hint is no subset: the pick is made from every endpoint", func(ctx context.Context, k *Kit) error {
		m := headers(http.MethodPost, k.o.Path, nil, false)
		m.MetadataContext = &corev3.Metadata{FilterMetadata: map[string]*structpb.Struct{"some.other.filter": {Fields: map[string]*structpb.Value{epp.SubsetKey: list("10.255.255.254:65000")}}}}
		p, _, err := k.picked(ctx, m, k.body("other namespace"))
		if err == nil {
			err = wantPick(p)
		}
		return err
	}},

	// Headers only the picker sets.
	{"owned/headers", "a client's x-prefiller-host-port and x-data-parallel-rank never survive the pick (removed, or replaced by the picker's own)", func(ctx context.Context, k *Kit) error {
		client := http.Header{"x-prefiller-host-port": {"10.66.66.66:8000"}, "x-data-parallel-rank": {"7"}}
		p, _, err := k.picked(ctx, headers(http.MethodPost, k.o.Path, client, false), k.body("owned headers"))
		if err == nil {
			err = wantPick(p)
		}
		if err != nil {
			return err
		}
		for name, theirs := range map[string]string{"x-prefiller-host-port": "10.66.66.66:8000", "x-data-parallel-rank": "7"} {
			gone := slices.ContainsFunc(p.mutation.GetRemoveHeaders(), func(h string) bool { return strings.EqualFold(h, name) })
			for _, h := range p.mutation.GetSetHeaders() {
				if strings.EqualFold(h.GetHeader().GetKey(), name) && string(h.GetHeader().GetRawValue()) != theirs && !appends(h) {
					gone = true
				}
			}
			if !gone {
				return fmt.Errorf("the client's %s passes the pick", name)
			}
		}
		return nil
	}},

	// Body modes.
	{"mode/streamed", "STREAMED: the headers are answered at once with a pick, then each body chunk is answered", func(ctx context.Context, k *Kit) error {
		st, err := k.client.Process(ctx)
		if err != nil {
			return err
		}
		defer st.CloseSend()
		if err := st.Send(withMode(headers(http.MethodPost, k.o.Path, nil, false), filterv3.ProcessingMode_STREAMED)); err != nil {
			return err
		}
		m, err := st.Recv()
		if err != nil {
			return err
		}
		if m.GetImmediateResponse() != nil {
			return nil // a picker may refuse a mode in which it cannot read the body first
		}
		p, err := readPick(m)
		if err == nil && m.GetRequestHeaders() == nil {
			err = fmt.Errorf("the headers were answered %T", m.Response)
		}
		if err == nil {
			err = wantPick(p)
		}
		if err != nil {
			return err
		}
		if err := st.Send(dataplane.RequestBody(k.body("streamed"), true)); err != nil {
			return err
		}
		if m, err = st.Recv(); err != nil {
			return err
		}
		if m.GetRequestBody() == nil && m.GetImmediateResponse() == nil {
			return fmt.Errorf("the body chunk was answered %T", m.Response)
		}
		return nil
	}},
	{"mode/none", "NONE: a request without a body is picked at its headers; one with a body is picked or refused at once, never left waiting", func(ctx context.Context, k *Kit) error {
		for _, eos := range []bool{true, false} {
			st, err := k.client.Process(ctx)
			if err != nil {
				return err
			}
			path := k.o.Path
			if eos {
				path = "/v1/models"
			}
			if err := st.Send(withMode(headers(http.MethodPost, path, nil, eos), filterv3.ProcessingMode_NONE)); err != nil {
				return err
			}
			m, err := st.Recv()
			_ = st.CloseSend()
			if err != nil {
				return fmt.Errorf("body %v: %w", !eos, err)
			}
			if m.GetRequestHeaders() == nil && m.GetImmediateResponse() == nil {
				return fmt.Errorf("body %v: answered %T", !eos, m.Response)
			}
		}
		return nil
	}},
	{"mode/buffered", "BUFFERED: the headers are answered at once, the pick rides on the body's answer", modeCase(filterv3.ProcessingMode_BUFFERED)},
	{"mode/buffered-partial", "BUFFERED_PARTIAL: as BUFFERED", modeCase(filterv3.ProcessingMode_BUFFERED_PARTIAL)},

	// The response path.
	{"response/headers", "the response headers are acknowledged", func(ctx context.Context, k *Kit) error {
		return k.respond(ctx, func(st extprocv3.ExternalProcessor_ProcessClient) error {
			if err := st.Send(respHeaders(200, "", false)); err != nil {
				return err
			}
			m, err := st.Recv()
			if err == nil && m.GetResponseHeaders() == nil {
				err = fmt.Errorf("answered %T", m.Response)
			}
			return err
		})
	}},
	{"response/body-relayed", "in full duplex mode each response body chunk comes back unchanged", func(ctx context.Context, k *Kit) error {
		return k.respond(ctx, func(st extprocv3.ExternalProcessor_ProcessClient) error {
			if err := st.Send(respHeaders(200, "", false)); err != nil {
				return err
			}
			if _, err := st.Recv(); err != nil {
				return err
			}
			chunks := [][]byte{[]byte("data: {\"choices\":[{\"text\":\"a\"}]}\n\n"), []byte("data: [DONE]\n\n")}
			var back bytes.Buffer
			for i, c := range chunks {
				if err := st.Send(dataplane.ResponseBody(c, i == len(chunks)-1)); err != nil {
					return err
				}
				m, err := st.Recv()
				if err != nil {
					return err
				}
				back.Write(m.GetResponseBody().GetResponse().GetBodyMutation().GetStreamedResponse().GetBody())
			}
			if !bytes.Equal(back.Bytes(), bytes.Join(chunks, nil)) {
				return fmt.Errorf("relayed %q", back.String())
			}
			return nil
		})
	}},
	{"response/served-metadata", "the served endpoint in the response's metadata is taken without error", func(ctx context.Context, k *Kit) error {
		return k.respondAs(ctx, func(st extprocv3.ExternalProcessor_ProcessClient, p pick) error {
			if err := st.Send(respHeaders(200, p.endpoints()[0], true)); err != nil {
				return err
			}
			m, err := st.Recv()
			if err == nil && m.GetResponseHeaders() == nil {
				err = fmt.Errorf("answered %T", m.Response)
			}
			return err
		})
	}},
	{"response/trailers", "response trailers are acknowledged", func(ctx context.Context, k *Kit) error {
		return k.respond(ctx, func(st extprocv3.ExternalProcessor_ProcessClient) error {
			if err := st.Send(respHeaders(200, "", false)); err != nil {
				return err
			}
			if _, err := st.Recv(); err != nil {
				return err
			}
			if err := st.Send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseTrailers{ResponseTrailers: &extprocv3.HttpTrailers{}}}); err != nil {
				return err
			}
			m, err := st.Recv()
			if err == nil && m.GetResponseTrailers() == nil {
				err = fmt.Errorf("answered %T", m.Response)
			}
			return err
		})
	}},
	{"response/clean-end", "after the response ends and the data plane closes, the stream ends cleanly", func(ctx context.Context, k *Kit) error {
		return k.respond(ctx, func(st extprocv3.ExternalProcessor_ProcessClient) error {
			if err := st.Send(respHeaders(200, "", true)); err != nil {
				return err
			}
			if _, err := st.Recv(); err != nil {
				return err
			}
			_ = st.CloseSend()
			if _, err := st.Recv(); err == nil {
				return errors.New("answered after the exchange ended")
			}
			return nil
		})
	}},

	// Immediate responses.
	{"immediate/not-json", "a body that is no JSON is refused with an immediate 4xx", func(ctx context.Context, k *Kit) error {
		p, _, err := k.picked(ctx, headers(http.MethodPost, k.o.Path, nil, false), []byte("{not json"))
		return wantImmediate(p, err, 400, 422)
	}},
	{"immediate/no-model", "a request naming no model is refused with an immediate 4xx, or picked (a picker may have a default model)", func(ctx context.Context, k *Kit) error {
		p, _, err := k.picked(ctx, headers(http.MethodPost, k.o.Path, nil, false), []byte(`{"prompt":"no model"}`))
		if err != nil {
			return err
		}
		if p.immediate != nil {
			if c := p.immediate.GetStatus().GetCode(); c < 400 || c > 499 {
				return fmt.Errorf("immediate response %d", c)
			}
		}
		return nil
	}},
	{"immediate/unknown-model", "a model no endpoint serves is an immediate 4xx or 503, never a pick of an endpoint that cannot serve it", func(ctx context.Context, k *Kit) error {
		p, _, err := k.picked(ctx, headers(http.MethodPost, k.o.Path, nil, false), []byte(`{"model":"no-such-model-anywhere","prompt":"x"}`))
		return wantImmediate(p, err, 400, 404, 503)
	}},

	// Malformed and out of order.
	{"order/body-first", "a request body before its headers breaks the exchange: the picker ends it", func(ctx context.Context, k *Kit) error {
		st, err := k.client.Process(ctx)
		if err != nil {
			return err
		}
		if err := st.Send(dataplane.RequestBody([]byte(`{}`), true)); err != nil {
			return err
		}
		return wantStreamError(st)
	}},
	{"order/response-first", "response headers before the request was answered break the exchange: the picker ends it", func(ctx context.Context, k *Kit) error {
		st, err := k.client.Process(ctx)
		if err != nil {
			return err
		}
		if err := st.Send(respHeaders(200, "", true)); err != nil {
			return err
		}
		return wantStreamError(st)
	}},
	{"order/headers-twice", "request headers twice in one exchange break it: the picker ends it", func(ctx context.Context, k *Kit) error {
		st, err := k.client.Process(ctx)
		if err != nil {
			return err
		}
		first := withMode(headers(http.MethodPost, k.o.Path, nil, false), fullDuplex)
		if err := st.Send(first); err != nil {
			return err
		}
		if err := st.Send(headers(http.MethodPost, k.o.Path, nil, false)); err != nil {
			return err
		}
		return wantStreamError(st)
	}},
	{"order/empty-message", "a message of no known kind breaks the exchange: the picker ends it", func(ctx context.Context, k *Kit) error {
		st, err := k.client.Process(ctx)
		if err != nil {
			return err
		}
		if err := st.Send(&extprocv3.ProcessingRequest{}); err != nil {
			return err
		}
		return wantStreamError(st)
	}},
	{"order/still-serving", "after broken and cancelled exchanges, the next one is picked", func(ctx context.Context, k *Kit) error {
		for i := 0; i < 3; i++ {
			cctx, cancel := context.WithCancel(ctx)
			st, err := k.client.Process(cctx)
			if err == nil {
				_ = st.Send(withMode(headers(http.MethodPost, k.o.Path, nil, false), fullDuplex))
				_ = st.Send(dataplane.RequestBody([]byte(`{"model":`), false))
			}
			cancel()
		}
		p, _, err := k.picked(ctx, headers(http.MethodPost, k.o.Path, nil, false), k.body("still serving"))
		if err == nil {
			err = wantPick(p)
		}
		return err
	}},
}

// Cases' helpers.

// appends reads a set header's deprecated append field, which Envoy still obeys.
func appends(h *corev3.HeaderValueOption) bool {
	//lint:ignore SA1019 the field is deprecated, but a picker may set it and Envoy obeys it
	return h.GetAppend().GetValue()
}

func healthCase(service string) func(context.Context, *Kit) error {
	return func(ctx context.Context, k *Kit) error {
		r, err := healthpb.NewHealthClient(k.health).Check(ctx, &healthpb.HealthCheckRequest{Service: service})
		if err != nil {
			return err
		}
		if r.GetStatus() != healthpb.HealthCheckResponse_SERVING {
			return fmt.Errorf("%s is %s", service, r.GetStatus())
		}
		return nil
	}
}

func modeCase(mode filterv3.ProcessingMode_BodySendMode) func(context.Context, *Kit) error {
	return func(ctx context.Context, k *Kit) error {
		st, err := k.client.Process(ctx)
		if err != nil {
			return err
		}
		defer st.CloseSend()
		if err := st.Send(withMode(headers(http.MethodPost, k.o.Path, nil, false), mode)); err != nil {
			return err
		}
		m, err := st.Recv()
		if err != nil {
			return err
		}
		if m.GetRequestHeaders() == nil {
			return fmt.Errorf("the headers were answered %T, not at once with a headers response", m.Response)
		}
		if err := st.Send(dataplane.RequestBody(k.body("buffered"), true)); err != nil {
			return err
		}
		if m, err = st.Recv(); err != nil {
			return err
		}
		p, err := readPick(m)
		if err == nil && m.GetRequestBody() == nil {
			err = fmt.Errorf("the body was answered %T", m.Response)
		}
		if err == nil {
			err = wantPick(p)
		}
		if err == nil && p.header != p.metadata {
			err = fmt.Errorf("header %q, metadata %q", p.header, p.metadata)
		}
		return err
	}
}

func respHeaders(code int, served string, eos bool) *extprocv3.ProcessingRequest {
	return dataplane.ResponseHeaders(code, http.Header{"Content-Type": {"text/event-stream"}}, served, eos)
}

// respond picks a request, then plays its response path with f.
func (k *Kit) respond(ctx context.Context, f func(extprocv3.ExternalProcessor_ProcessClient) error) error {
	return k.respondAs(ctx, func(st extprocv3.ExternalProcessor_ProcessClient, _ pick) error { return f(st) })
}

func (k *Kit) respondAs(ctx context.Context, f func(extprocv3.ExternalProcessor_ProcessClient, pick) error) error {
	st, p, _, err := k.exchange(ctx, withMode(headers(http.MethodPost, k.o.Path, nil, false), fullDuplex), k.body("respond"))
	if st != nil {
		defer st.CloseSend()
	}
	if err == nil {
		err = wantPick(p)
	}
	if err != nil {
		return err
	}
	return f(st, p)
}
