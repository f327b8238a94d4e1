package gateway

import (
	"encoding/json"
	"net/http"
	"net/url"
	"strconv"

	"github.com/kvgate/kvgate/store"
)

// The console's webhook pages (console.go): endpoints, their deliveries
// with every attempt, and redelivery, each an API call as the session's
// key, like every other page.

type webhooksData struct {
	Endpoints []endpointView
	Events    []string
	NewSecret *endpointView // a created or rotated endpoint, its secret shown once
}

func (s *Server) webhooksData(r *http.Request, u consoleUser) (webhooksData, error) {
	d := webhooksData{Events: store.WebhookEvents}
	var l struct {
		Data []endpointView `json:"data"`
	}
	err := s.consoleGet(r, u, "/v1/webhooks/endpoints", &l)
	d.Endpoints = l.Data
	return d, err
}

func (s *Server) consoleWebhooks(w http.ResponseWriter, r *http.Request, u consoleUser) {
	d, err := s.webhooksData(r, u)
	s.page(w, r, u, "webhooks", "Webhooks", d, err)
}

// consoleShowSecret renders the endpoints with a new secret, once, on the
// page (never in a URL), or the API's refusal.
func (s *Server) consoleShowSecret(w http.ResponseWriter, r *http.Request, u consoleUser, status int, b []byte) {
	d, err := s.webhooksData(r, u)
	if status >= 300 {
		s.page(w, r, u, "webhooks", "Webhooks", d, apiMessage(status, b))
		return
	}
	var e endpointView
	_ = json.Unmarshal(b, &e)
	d.NewSecret = &e
	s.page(w, r, u, "webhooks", "Webhooks", d, err)
}

func (s *Server) consoleCreateEndpoint(w http.ResponseWriter, r *http.Request, u consoleUser) {
	_ = r.ParseForm()
	target, desc, inc := r.PostFormValue("url"), r.PostFormValue("description"), r.PostFormValue("include_result") == "true"
	req := endpointRequest{URL: &target, Events: r.PostForm["events"], Description: &desc, IncludeResult: &inc}
	status, b := s.consoleCall(r, u, http.MethodPost, "/v1/webhooks/endpoints", req)
	s.consoleShowSecret(w, r, u, status, b)
}

func (s *Server) consoleRotateSecret(w http.ResponseWriter, r *http.Request, u consoleUser) {
	status, b := s.consoleCall(r, u, http.MethodPost, "/v1/webhooks/endpoints/"+url.PathEscape(r.PathValue("id"))+"/rotate-secret", nil)
	s.consoleShowSecret(w, r, u, status, b)
}

// consoleEndpointState disables or enables an endpoint (PATCH disabled).
func (s *Server) consoleEndpointState(w http.ResponseWriter, r *http.Request, u consoleUser) {
	id := r.PathValue("id")
	off := r.PostFormValue("disabled") == "true"
	done := "Endpoint " + id + " enabled."
	if off {
		done = "Endpoint " + id + " disabled: its deliveries wait, none sent or failed, until it is enabled again."
	}
	s.consoleActionAs(w, r, u, http.MethodPatch, "/v1/webhooks/endpoints/"+url.PathEscape(id), endpointRequest{Disabled: &off}, done)
}

func (s *Server) consoleTestEndpoint(w http.ResponseWriter, r *http.Request, u consoleUser) {
	id := r.PathValue("id")
	s.consoleAction(w, r, u, "/v1/webhooks/endpoints/"+url.PathEscape(id)+"/test", nil, "A webhook.test delivery to "+id+" is on its way.")
}

func (s *Server) consoleRedeliver(w http.ResponseWriter, r *http.Request, u consoleUser) {
	id := r.PathValue("id")
	s.consoleAction(w, r, u, "/v1/webhooks/deliveries/"+url.PathEscape(id)+"/redeliver", nil, "Delivery "+id+" redelivered.")
}

type endpointData struct {
	Endpoint   endpointView
	Deliveries []deliveryView // each with its attempts
	States     []string
	State      string
	NextURL    string
}

func (s *Server) consoleEndpoint(w http.ResponseWriter, r *http.Request, u consoleUser) {
	id := url.PathEscape(r.PathValue("id"))
	q := r.URL.Query()
	d := endpointData{States: deliveryStates, State: q.Get("state")}
	err := s.consoleGet(r, u, "/v1/webhooks/endpoints/"+id, &d.Endpoint)
	if err == nil {
		api := url.Values{"limit": {strconv.Itoa(consolePageSize)}, "include": {"attempts"}}
		for _, k := range []string{"after", "state"} {
			if v := q.Get(k); v != "" {
				api.Set(k, v)
			}
		}
		var pg struct {
			Data       []deliveryView `json:"data"`
			NextCursor string         `json:"next_cursor"`
		}
		if err = s.consoleGet(r, u, "/v1/webhooks/endpoints/"+id+"/deliveries?"+api.Encode(), &pg); err == nil {
			d.Deliveries = pg.Data
			if pg.NextCursor != "" {
				next := url.Values{"after": {pg.NextCursor}, "state": {d.State}}
				if t := q.Get("tenant"); t != "" {
					next.Set("tenant", t) // an admin's read of another tenant's endpoint
				}
				d.NextURL = "/console/webhooks/endpoints/" + id + "?" + next.Encode()
			}
		}
	}
	s.pageAs(w, r, u, "webhooks", "endpoint", "Webhook endpoint "+r.PathValue("id"), d, err)
}

func (s *Server) consoleDelivery(w http.ResponseWriter, r *http.Request, u consoleUser) {
	var d deliveryView
	err := s.consoleGet(r, u, "/v1/webhooks/deliveries/"+url.PathEscape(r.PathValue("id")), &d)
	s.pageAs(w, r, u, "webhooks", "delivery", "Webhook delivery "+r.PathValue("id"), d, err)
}

// redeliverable says whether a delivery's state allows a redelivery.
func redeliverable(state string) bool {
	return state == store.DeliveryFailed || state == store.DeliveryDelivered
}
