//! What the benchmark examples (`consume_rate`, `relay_rate`) share: their
//! arguments and their summary lines.

/// The arguments `[COUNT] [CASE ...]`: COUNT (default `count`) and the
/// cases (default `cases`).
pub(crate) fn args(count: usize, cases: &[usize]) -> anyhow::Result<(usize, Vec<usize>)> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let count = args.first().map_or(Ok(count), |a| a.parse())?;
    let cases = if args.len() > 1 {
        args[1..]
            .iter()
            .map(|a| a.parse())
            .collect::<Result<_, _>>()?
    } else {
        cases.to_vec()
    };
    Ok((count, cases))
}

/// Prints, for each case of `cases`, the median of its `rates` (`(case,
/// rate)`, two runs each: the middle of the lowest and the highest) as a
/// JSON line `{"<case_name>": case, "median_<rate_name>": median}`.
pub(crate) fn print_medians(
    case_name: &str,
    rate_name: &str,
    cases: &[usize],
    rates: &[(usize, f64)],
) {
    for &case in cases {
        let mut r: Vec<f64> = rates
            .iter()
            .filter(|(c, _)| *c == case)
            .map(|(_, r)| *r)
            .collect();
        r.sort_by(f64::total_cmp);
        if let (Some(low), Some(high)) = (r.first(), r.last()) {
            let median = (low + high) / 2.0;
            println!("{{\"{case_name}\": {case}, \"median_{rate_name}\": {median:.0}}}");
        }
    }
}
